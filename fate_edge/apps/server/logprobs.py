"""OpenAI ``logprobs``: the sampled tokens' (from :class:`~fate_edge.runtime.token_logprobs.TokenLogprob` on each
step) and, for completions with ``echo``, the prompt's own tokens, scored in one teacher-forced prefill.

Every figure is ``log_softmax`` of the model's raw logits, before temperature and the other sampling filters, as
OpenAI and vLLM report them. The first prompt token has no logprob (nothing precedes it): ``null``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from fate_edge.errors import KVRoomError
from fate_edge.runtime.token_logprobs import TokenLogprob, logprob_rows
from fate_edge.sizes import format_bytes

SCORE_CHUNK = 128  # prompt positions per pass when scoring: a chunk's logits are [chunk, V] floats


def kv_room(eng: Any) -> tuple[int, int]:
    """(the KV room in bytes, bytes per position) of a batching engine; (0, 0) where none is declared."""
    batcher = getattr(eng, "batcher", None)
    if batcher is None:
        return 0, 0
    return batcher.config.kv_budget_bytes, batcher.config.kv_bytes_per_token


@torch.inference_mode()
def score_prompt(eng: Any, ids: list[int], top: int, wait_s: float = 600.0) -> list[TokenLogprob | None]:
    """Each prompt token's log-probability given the tokens before it (None for the first), from the model's
    logits at every position of one prefill (``MoETransformer.forward`` without ``last_only``).

    The pass runs on the batcher's thread between two steps, under the engine's lock. Its KV cache is a range of the
    batch's KV slab, like a request's (so the memory budget covers it), waited for while the slab is full and given
    back when done."""
    room, per_token = kv_room(eng)
    if room and per_token * len(ids) > room:
        raise KVRoomError(
            f"scoring this prompt needs {format_bytes(per_token * len(ids))} of KV cache ({len(ids)} tokens) but the "
            f"budget holds {format_bytes(room)}; shorten the prompt or raise --context-tokens"
        )
    model = eng.model
    cache = _slab_cache(eng, len(ids), wait_s) if room and per_token else None
    own = cache is None
    if own:
        cache = model.new_cache()
        cache.capacity_hint = len(ids)
    out: list[TokenLogprob | None] = [None]

    @torch.inference_mode()
    def score() -> None:
        with eng._lock:  # one step of anything at a time (the batcher's steps take the same lock)
            try:
                for a in range(0, len(ids) - 1, SCORE_CHUNK):
                    b = min(a + SCORE_CHUNK, len(ids) - 1)
                    x = torch.tensor([ids[a:b]], device=model.device)
                    logits = model(x, cache)[0]  # [b - a, V]: position i predicts token i + 1
                    out.extend(logprob_rows(logits, ids[a + 1 : b + 1], top))
            except BaseException:
                eng.scheduler.abort()  # nothing of this pass stays in flight
                raise

    try:
        # on the batcher's thread where there is one: the process's only thread computing with several threads
        # (Batcher.call); the KV range was waited for here, as the batcher's steps free it
        eng.batcher.call(score) if eng.batcher is not None else score()
    finally:
        if not own:
            batcher = eng.batcher
            with batcher._cv:
                batcher._slab.release(cache)
                batcher._cv.notify_all()
    return out


def _slab_cache(eng: Any, positions: int, wait_s: float) -> Any:
    """A range of ``positions`` of the batcher's KV slab (made with the batcher where it has a KV budget), waiting
    up to ``wait_s`` seconds while running sequences hold it all. Reads the batcher's slab under its condition."""
    from fate_edge.model.kv_slab import KVSlab

    batcher = eng.batcher
    c = batcher.config
    deadline = time.monotonic() + wait_s
    with batcher._cv:
        if batcher._slab is None:
            batcher._slab = KVSlab(eng.model, c.kv_budget_bytes // c.kv_bytes_per_token)
        while True:
            cache = batcher._slab.allocate(positions)
            if cache is not None:
                return cache
            left = deadline - time.monotonic()
            if left <= 0:
                raise KVRoomError(
                    f"no KV room for scoring {positions} prompt tokens within {wait_s:.0f} s: the running requests "
                    "hold it all; retry later"
                )
            batcher._cv.wait(min(left, 0.05))  # a leaving sequence frees its range without a notify


def _text(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


def _top_map(tokenizer: Any, e: TokenLogprob) -> dict[str, float]:
    top: dict[str, float] = {}
    for t, lp in e.top:
        top.setdefault(_text(tokenizer, t), lp)  # two ids with one text: the likelier one's (as vLLM)
    return top


class CompletionLogprobs:
    """The completions API's ``logprobs`` object (``tokens``, ``token_logprobs``, ``top_logprobs``,
    ``text_offset``), built a token at a time; offsets count characters from the start of the returned text."""

    def __init__(self, tokenizer: Any, offset: int = 0):
        self.tokenizer = tokenizer
        self.offset = offset

    def entries(self, items: list[TokenLogprob | None], tokens: list[int]) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, e in zip(tokens, items):
            text = _text(self.tokenizer, token)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if e is None else e.logprob)
            top = None if e is None else _top_map(self.tokenizer, e)
            if top is not None and e is not None and text not in top:
                top[text] = e.logprob  # the chosen token is always listed, as OpenAI does
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def merge(into: dict[str, Any] | None, more: dict[str, Any]) -> dict[str, Any]:
    if into is None:
        return more
    for key in into:
        into[key].extend(more[key])
    return into


def chat_entry(tokenizer: Any, e: TokenLogprob) -> dict[str, Any]:
    """One ``choices[].logprobs.content`` item of the chat API."""
    text = _text(tokenizer, e.token)
    return {
        "token": text,
        "logprob": e.logprob,
        "bytes": list(text.encode("utf-8")),
        "top_logprobs": [
            {"token": (t := _text(tokenizer, i)), "logprob": lp, "bytes": list(t.encode("utf-8"))} for i, lp in e.top
        ],
    }
