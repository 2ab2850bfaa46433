"""Generation as a generator: prefill, then one token per step, each step yielding its text and stats.

Modelled on mlx-lm's ``stream_generate``: callers iterate and get a :class:`GenerationResponse` per token.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from fate_edge.errors import ContextLengthError, DeviceMemoryError, GenerationError
from fate_edge.model.transformer import MoETransformer
from fate_edge.process_memory import peak_rss_bytes
from fate_edge.runtime.sampling import Sampler, SamplingParams
from fate_edge.tokenizer import StreamingDetokenizer, Tokenizer


@dataclass
class GenerationResponse:
    text: str  # text produced by this step (may be empty while a character or stop string is incomplete)
    token: int | None
    prompt_tokens: int
    generation_tokens: int
    prompt_tps: float
    generation_tps: float
    peak_rss_bytes: int  # read every RSS_EVERY tokens and on the final response (a /proc read costs ~30 µs)
    finish_reason: str | None = None  # None while running, then "stop" or "length"


RSS_EVERY = 32  # decode tokens between peak-RSS reads
PREFILL_CHUNK = 512  # default prompt tokens per forward pass (GenerateConfig.prefill_chunk)


@dataclass
class GenerateConfig:
    # None: until end of text or the context is full (as llama-server and Ollama do)
    max_tokens: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)  # stop strings: generation ends before them
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop tokens beyond the model's EOS
    ignore_eos: bool = False
    # Prompt tokens per forward pass: a long prompt's activations (not its KV cache) are bounded by this, at the
    # cost of reading the weights once per chunk. 0: the whole prompt in one pass.
    prefill_chunk: int = PREFILL_CHUNK
    # Positions (prompt and answer) an unbounded request may fill: the engine's KV room (its context_tokens);
    # None: the model's context
    context_limit: int | None = None


def _hold_back(text: str, stops: list[str]) -> int:
    """How many trailing characters of ``text`` could still become the start of a stop string."""
    keep = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                keep = max(keep, n)
                break
    return keep


def check_context(prompt_tokens: int, context: int) -> None:
    """Raise :class:`ContextLengthError` unless the prompt and at least one generated token fit in ``context``."""
    if prompt_tokens >= context:
        raise ContextLengthError(prompt_tokens, context)


def prompt_chunks(n: int, chunk: int) -> list[tuple[int, int]]:
    """[start, stop) ranges covering ``n`` prompt tokens, ``chunk`` at a time (0: one range). A last range of one
    token borrows one from the range before it, so every range of a prompt longer than one token runs as a prompt
    (a one-token forward is a decode step to the model and the scheduler)."""
    if chunk <= 0:
        return [(0, n)]
    chunk = max(chunk, 3)  # so a range that lends a token keeps two
    if n <= chunk:
        return [(0, n)]
    stops = list(range(chunk, n, chunk)) + [n]
    if stops[-1] - (stops[-2] if len(stops) > 1 else 0) == 1:
        stops[-2] -= 1
    return list(zip([0, *stops[:-1]], stops))


def _forward(model: MoETransformer, ids: list[int], cache, last_only: bool, stage: str) -> torch.Tensor:
    """One forward pass over ``ids`` (one sequence); the device running out of memory becomes a one-line
    :class:`DeviceMemoryError` (the pass holds nothing afterwards: its KV cache is the request's and goes with it)."""
    # One decode token is written on the device by a fill kernel: no host-to-device copy (and wait) per token.
    x = (
        torch.full((1, 1), ids[0], dtype=torch.long, device=model.device)
        if len(ids) == 1
        else torch.tensor([ids], device=model.device)
    )
    try:
        return model(x, cache, last_only=last_only)[0, -1]
    except torch.OutOfMemoryError as exc:
        if model.device.type == "cuda":
            torch.cuda.empty_cache()  # the failed pass's blocks back to the driver before anyone retries
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else "out of memory"
        raise DeviceMemoryError(
            f"{model.device.type} ran out of memory during the {stage} at position {cache.length} ({first}); the "
            "request was stopped and holds nothing: retry with a shorter prompt or --max-tokens, a lower "
            "--memory-budget, or more free device memory"
        ) from None


def prepare_prompt(
    model: MoETransformer, tokenizer: Tokenizer, prompt: str | list[int], config: GenerateConfig
) -> tuple[list[int], int]:
    """A request checked before any compute: its prompt ids and the most tokens it may generate in the context.
    Bad values raise :class:`GenerationError` (:class:`ContextLengthError` for a prompt that fills the context)."""
    if config.max_tokens is not None and config.max_tokens < 0:
        raise GenerationError(f"max_tokens must be >= 0, got {config.max_tokens}")
    if config.prefill_chunk < 0:
        raise GenerationError(f"prefill_chunk must be >= 0 (0: the whole prompt at once), got {config.prefill_chunk}")
    prompt_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not prompt_ids:
        raise GenerationError("the prompt is empty; give at least one token of text")
    context = model.config.max_position_embeddings
    check_context(len(prompt_ids), context)
    if config.max_tokens is not None:
        return prompt_ids, min(config.max_tokens, context - len(prompt_ids))
    room = min(context, config.context_limit or context)
    if len(prompt_ids) >= room:
        raise ContextLengthError(
            len(prompt_ids), room, "the engine's context", " or raise --context-tokens (context_tokens)"
        )
    return prompt_ids, room - len(prompt_ids)


class TokenStream:
    """The text side of one request, after each forward pass: sampling, stop tokens and strings, text held back
    while it may begin a stop string, and the :class:`GenerationResponse` of each token. One sequence alone
    (:func:`stream_generate`) and a sequence in a batch (``runtime.batch``) both go through it."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], config: GenerateConfig, max_tokens: int):
        self.config = config
        self.max_tokens = max_tokens
        self.prompt_tokens = len(prompt_ids)
        self.sampler = Sampler(config.sampling)
        self.stop_ids = set(config.stop_token_ids) | (set() if config.ignore_eos else tokenizer.eos_token_ids)
        self.detok = StreamingDetokenizer(tokenizer)
        self.history = list(prompt_ids)
        self.pending = ""  # text held back because it might begin a stop string
        self.n = 0  # tokens generated
        self.token: int | None = None  # the last token sampled
        self.prompt_tps = 0.0
        self.t_gen = time.perf_counter()
        self.rss = 0  # read when the prompt is done, every RSS_EVERY tokens and on the final response

    def prompt_done(self, seconds: float) -> None:
        """The prompt has run (in ``seconds``): generation timing starts now."""
        self.prompt_tps = self.prompt_tokens / seconds if seconds > 0 else 0.0
        self.t_gen = time.perf_counter()
        self.rss = peak_rss_bytes()

    def response(self, text: str, token: int | None, finish: str | None) -> GenerationResponse:
        elapsed = time.perf_counter() - self.t_gen
        if finish is not None or self.n % RSS_EVERY == 0:
            self.rss = peak_rss_bytes()
        return GenerationResponse(
            text,
            token,
            self.prompt_tokens,
            self.n,
            self.prompt_tps,
            self.n / elapsed if elapsed > 0 else 0.0,
            self.rss,
            finish,
        )

    def step(self, logits: torch.Tensor) -> GenerationResponse:
        """Sample the next token from ``logits`` [V]; its response (``finish_reason`` set when the request ends)."""
        token = self.token = self.sampler(logits, self.history)
        self.n += 1
        self.history.append(token)
        if token in self.stop_ids:
            return self.response(self.pending + self.detok.flush(), token, "stop")
        self.pending += self.detok.add(token)
        if self.n >= self.max_tokens:
            self.pending += self.detok.flush()
        stops = self.config.stop
        if stops:
            hit = min((i for i in (self.pending.find(s) for s in stops) if i >= 0), default=-1)
            if hit >= 0:
                return self.response(self.pending[:hit], token, "stop")
        if self.n >= self.max_tokens:
            return self.response(self.pending, token, "length")
        keep = _hold_back(self.pending, stops)
        pending = self.pending
        out, self.pending = (pending[: len(pending) - keep], pending[len(pending) - keep :]) if keep else (pending, "")
        return self.response(out, token, None)


@torch.inference_mode()
def stream_generate(
    model: MoETransformer,
    tokenizer: Tokenizer,
    prompt: str | list[int],
    config: GenerateConfig | None = None,
) -> Iterator[GenerationResponse]:
    config = config or GenerateConfig()
    prompt_ids, max_tokens = prepare_prompt(model, tokenizer, prompt, config)
    out = TokenStream(tokenizer, prompt_ids, config, max_tokens)
    cache = model.new_cache()
    cache.capacity_hint = len(prompt_ids) + max_tokens  # allocated once: no copy of a doubled cache mid-answer

    t0 = time.perf_counter()
    *first, last = prompt_chunks(len(prompt_ids), config.prefill_chunk)
    for a, b in first:  # every chunk but the last leaves its keys and values; its logits are not needed
        _forward(model, prompt_ids[a:b], cache, True, "prompt")
    logits = _forward(model, prompt_ids[last[0] : last[1]], cache, True, "prompt")
    if logits.device.type == "cuda":  # kernels run asynchronously: the prompt is done when the GPU is
        torch.cuda.synchronize(logits.device)
    out.prompt_done(time.perf_counter() - t0)
    if max_tokens == 0:
        yield out.response("", None, "length")
        return
    while True:
        step = out.step(logits)
        yield step
        if step.finish_reason is not None:
            return
        assert out.token is not None  # a step that did not finish sampled a token
        logits = _forward(model, [out.token], cache, False, "decode")


def generate(
    model: MoETransformer, tokenizer: Tokenizer, prompt: str | list[int], config: GenerateConfig | None = None
) -> tuple[str, GenerationResponse]:
    """The whole completion and the final step's stats."""
    parts, last = [], None
    for last in stream_generate(model, tokenizer, prompt, config):
        parts.append(last.text)
    assert last is not None
    return "".join(parts), last
