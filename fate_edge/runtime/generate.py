"""Generation as a generator: prefill, then one token per step, each step yielding its text and stats.

Modelled on mlx-lm's ``stream_generate`` (here ``stream_from_model``): callers iterate and get a
:class:`GenerationResponse` per token. One request alone is a batch of one: a :class:`Sequence` stepped by the batch's
step (``batch_step.forward_segments``, whose one-sequence case is the model's own forward), as every sequence of a
continuous batch is (``runtime.batch``); only who iterates differs (this generator, or the batch's worker thread).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from fate_edge.errors import ContextLengthError, DeviceMemoryError, GenerationError
from fate_edge.model.batch_step import Segment, forward_segments
from fate_edge.model.transformer import MoETransformer
from fate_edge.process_memory import peak_rss_bytes
from fate_edge.runtime.sampling import Sampler, SamplingParams
from fate_edge.runtime.token_logprobs import TokenLogprob, token_logprob
from fate_edge.tokenizer import StreamingDetokenizer, Tokenizer

if TYPE_CHECKING:
    from fate_edge.model.kv_cache import KVCache
    from fate_edge.runtime.prompt_cache import PromptCache


@dataclass
class GenerationResponse:
    text: str  # text produced by this step (may be empty while a character or stop string is incomplete)
    token: int | None
    prompt_tokens: int
    generation_tokens: int
    prompt_tps: float
    generation_tps: float
    peak_rss_bytes: int  # read every RSS_EVERY tokens and on the final response (a /proc read is not free)
    finish_reason: str | None = None  # None while running, then "stop" or "length"
    logprob: TokenLogprob | None = None  # this token's, when GenerateConfig.logprobs asks (not for a stop token)
    cached_tokens: int = 0  # prompt positions taken from the prompt cache, not run (OpenAI's usage reports them)


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
    # llguidance grammar text (runtime.structured): the answer is constrained to it token by token; None: free text
    grammar: str | None = None
    # Each sampled token's log-probability with this many likeliest alternatives (0: the token's alone); None: off
    logprobs: int | None = None
    # Start from the longest kept prefix of the prompt and keep this request's state when it ends
    # (runtime.prompt_cache; llama-server's name); False: neither
    cache_prompt: bool = True


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


def _step(model: MoETransformer, seq: Sequence) -> torch.Tensor:
    """``seq``'s next segment as a batch of one → its logits [V]; the device running out of memory becomes a one-line
    :class:`DeviceMemoryError` (the pass holds nothing afterwards: its KV cache is the request's and goes with it)."""
    assert seq.cache is not None  # a sequence being stepped holds its cache
    try:
        return forward_segments(model, [seq.segment()])[0]
    except torch.OutOfMemoryError as exc:
        if model.device.type == "cuda":
            torch.cuda.empty_cache()  # the failed pass's blocks back to the driver before anyone retries
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else "out of memory"
        stage = "prompt" if seq.chunks else "decode"
        raise DeviceMemoryError(
            f"{model.device.type} ran out of memory during the {stage} at position {seq.cache.length} ({first}); "
            "the request was stopped and holds nothing: retry with a shorter prompt or --max-tokens, a lower "
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
    (:func:`stream_from_model`) and a sequence in a batch (``runtime.batch``) both go through it."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], config: GenerateConfig, max_tokens: int):
        self.config = config
        self.max_tokens = max_tokens
        self.prompt_tokens = len(prompt_ids)
        self.cached_tokens = 0  # of them, restored from the prompt cache (Sequence.start_from)
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
        self.grammar = None
        if config.grammar is not None:  # structured output: the grammar masks the logits before each sample
            from fate_edge.runtime.structured import GrammarMask

            self.grammar = GrammarMask(tokenizer, config.grammar)

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
            cached_tokens=self.cached_tokens,
        )

    def step(self, logits: torch.Tensor) -> GenerationResponse:
        """Sample the next token from ``logits`` [V]; its response (``finish_reason`` set when the request ends)."""
        raw = logits  # logprobs are the model's own, before the grammar's mask (as vLLM's default reports them)
        if self.grammar is not None:
            logits = self.grammar.apply(logits)
        token = self.token = self.sampler(logits, self.history)
        self.n += 1
        self.history.append(token)
        if token in self.stop_ids:
            return self.response(self.pending + self.detok.flush(), token, "stop")
        resp = self._respond(token)
        if self.config.logprobs is not None:
            resp.logprob = token_logprob(raw, token, self.config.logprobs)
        return resp

    def _respond(self, token: int) -> GenerationResponse:
        if self.grammar is not None:
            self.grammar.consume(token)
            if self.grammar.finished:  # accepted, and nothing may follow: the answer is complete
                return self.response(self.pending + self.detok.add(token) + self.detok.flush(), token, "stop")
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


class Sequence:
    """One request between steps: its prompt chunks still to run, its KV cache and its text side. A step takes its
    :meth:`segment` (the next prompt chunk, or the last sampled token) and hands that segment's logits to
    :meth:`advance`. Alone (:func:`stream_from_model`) or in a batch (``runtime.batch.BatchSequence``), the same."""

    def __init__(self, prompt_ids: list[int], config: GenerateConfig, out: TokenStream, cache: KVCache | None):
        self.prompt_ids = prompt_ids
        self.config = config
        self.out = out
        self.cache = cache  # made when it starts stepping (a batch: a range of its KV slab, at admission)
        self.chunks = deque(prompt_chunks(len(prompt_ids), config.prefill_chunk))
        self.t_join = 0.0  # when its prompt started running
        self.reused = 0  # prompt positions its cache started with (runtime.prompt_cache)

    def start_from(self, cache: PromptCache | None) -> None:
        """Its (empty) cache from the longest kept prefix of its prompt, where the request allows: only the rest
        of the prompt is run."""
        if cache is None or not self.config.cache_prompt or self.cache is None:
            return
        n = cache.restore(self.cache, self.prompt_ids)
        if n:
            self.reused = self.out.cached_tokens = n
            rest = prompt_chunks(len(self.prompt_ids) - n, self.config.prefill_chunk)
            self.chunks = deque((a + n, b + n) for a, b in rest)

    def keep_in(self, cache: PromptCache | None) -> None:
        """Its state kept in ``cache`` under the tokens it holds, where the request allows (it ended well)."""
        if cache is None or not self.config.cache_prompt or self.cache is None or not self.cache.length:
            return
        cache.keep(self.cache, self.out.history[: self.cache.length])

    def segment(self) -> Segment:
        """What the next step runs for it: its next prompt chunk, or its last sampled token."""
        assert self.cache is not None  # only a sequence that left has no cache
        if self.chunks:
            a, b = self.chunks[0]
            return Segment(self.prompt_ids[a:b], self.cache)
        assert self.out.token is not None  # past its prompt, a sequence has sampled a token
        return Segment([self.out.token], self.cache)

    @property
    def rows(self) -> int:
        """How many tokens its next :meth:`segment` runs (its next prompt chunk's, or one)."""
        if self.chunks:
            a, b = self.chunks[0]
            return b - a
        return 1

    def advance(self, logits: torch.Tensor) -> GenerationResponse | None:
        """The step's logits [V] for :meth:`segment` → the token's response, or None after a prompt chunk that is not
        its last (those logits are not needed). Sampling errors propagate (the request's alone)."""
        if self.chunks:
            self.chunks.popleft()
            if self.chunks:
                return None
            if logits.device.type == "cuda":  # kernels run asynchronously: the prompt is done when the GPU is
                torch.cuda.synchronize(logits.device)
            self.out.prompt_done(time.perf_counter() - self.t_join)
            if self.out.max_tokens == 0:  # the prompt ran (its keys, its statistics); nothing to sample
                return self.out.response("", None, "length")
        return self.out.step(logits)


@torch.inference_mode()
def stream_from_model(
    model: MoETransformer,
    tokenizer: Tokenizer,
    prompt: str | list[int],
    config: GenerateConfig | None = None,
    prompt_cache: PromptCache | None = None,
) -> Iterator[GenerationResponse]:
    config = config or GenerateConfig()
    prompt_ids, max_tokens = prepare_prompt(model, tokenizer, prompt, config)
    out = TokenStream(tokenizer, prompt_ids, config, max_tokens)
    cache = model.new_cache()
    cache.capacity_hint = len(prompt_ids) + max_tokens  # allocated once: no copy of a doubled cache mid-answer
    seq = Sequence(prompt_ids, config, out, cache)
    seq.t_join = time.perf_counter()
    seq.start_from(prompt_cache)
    while True:  # a batch of one
        step = seq.advance(_step(model, seq))
        if step is None:
            continue
        if step.finish_reason is not None:
            seq.keep_in(prompt_cache)  # before the caller sees the end: its next request finds it
        yield step
        if step.finish_reason is not None:
            return


def generate_from_model(
    model: MoETransformer, tokenizer: Tokenizer, prompt: str | list[int], config: GenerateConfig | None = None
) -> tuple[str, GenerationResponse]:
    """The whole completion and the final step's stats."""
    parts, last = [], None
    for last in stream_from_model(model, tokenizer, prompt, config):
        parts.append(last.text)
    assert last is not None
    return "".join(parts), last
