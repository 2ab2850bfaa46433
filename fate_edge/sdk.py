"""Keyword-argument helpers over :class:`fate_edge.Engine` for applications (mobile backends, daemons, scripts).

    from fate_edge import Engine
    from fate_edge.sdk import generate

    with Engine.load(memory_budget="64MB") as engine:          # bundled model, converted once into the cache
        done = generate(engine, "def main():", max_tokens=32, temperature=0.7, seed=1)
        print(done.text, done.finish_reason, done.stats.hit_rate)

Every helper is safe to call from several threads at once. ``Engine.load`` batches concurrent requests
(``max_batch``, by default 8 on a CPU and 16 on a GPU): they run together, one forward per step over every
active sequence, each with its own KV cache, sampling and stops, and each stream yields its own tokens. A
seeded request gives the same text whatever else runs (greedy text at fp32 is the same alone or batched;
docs/batching.md states how often batching changes a token at bf16 and int4). With ``max_batch=1`` requests
are served one at a time.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from fate_edge.errors import GenerationError
from fate_edge.runtime.generate import GenerateConfig, GenerationResponse
from fate_edge.runtime.sampling import SamplingParams

if TYPE_CHECKING:
    from fate_edge.runtime.engine import Completion, Engine


def generate_config(
    max_tokens: int | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    ignore_eos: bool = False,
) -> GenerateConfig:
    """A validated :class:`GenerateConfig` from keyword arguments (``temperature=0`` is greedy). ``max_tokens``
    None (the default): until end of text or the engine's context (``context_tokens``), as llama-server and Ollama.

    Raises :class:`GenerationError` with the offending parameter named when a value is out of range.
    """
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0):
        raise GenerationError(f"max_tokens must be an integer >= 0 or None (until end of text), got {max_tokens!r}")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not isinstance(s, str) or not s for s in stops):
        raise GenerationError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    sampling = SamplingParams(
        float(temperature), int(top_k), float(top_p), float(min_p), float(repetition_penalty), seed
    )
    sampling.validate()
    return GenerateConfig(
        max_tokens, sampling, stop=stops, stop_token_ids=list(stop_token_ids or []), ignore_eos=bool(ignore_eos)
    )


def _config(config: GenerateConfig | None, kw: dict[str, Any]) -> GenerateConfig:
    if config is not None and kw:
        raise TypeError("pass either a GenerateConfig or keyword arguments, not both")
    return config if config is not None else generate_config(**kw)


def stream(
    engine: Engine, prompt: str | list[int], config: GenerateConfig | None = None, **kw: Any
) -> Iterator[GenerationResponse]:
    """Yield one :class:`GenerationResponse` per generated token (keywords as :func:`generate_config`).

    Stop iterating (or call ``.close()`` on the iterator) to cancel: the request leaves the batch before the
    next step (or, unbatched, the engine is free for the next request), and the others go on.
    """
    steps = engine.stream(prompt, _config(config, kw))
    try:
        yield from steps  # closing this iterator closes the engine's, which releases its lock
    except Exception:
        recover(engine)
        raise
    finally:
        steps.close()


def generate(engine: Engine, prompt: str | list[int], config: GenerateConfig | None = None, **kw: Any) -> Completion:
    """Complete ``prompt`` and return a typed :class:`~fate_edge.runtime.engine.Completion` (:meth:`Engine.complete`).

    Unlike reading ``engine.request_stats`` afterwards, ``Completion.stats`` is captured while the
    engine still serves this request, so it is this request's even when other threads are waiting.
    """
    return engine.complete(prompt, _config(config, kw))


def chat(engine: Engine, messages: list[dict[str, Any]], config: GenerateConfig | None = None, **kw: Any) -> Completion:
    """Render ``messages`` ([{"role": "user", "content": "..."}]) with the chat template and complete the reply
    (:meth:`Engine.chat`)."""
    return engine.chat(messages, _config(config, kw))


def recover(engine: Engine) -> None:
    """Bring the engine back to a clean state after a request failed part way (a read error, say):
    nothing in flight, every read buffer back in the pool, nothing pinned. The engine already does this
    when a request fails or is closed early; calling it again is harmless."""
    engine.abort()


def request_stats(completion: Completion) -> dict[str, float]:
    """A flat dict of a completion's expert-cache figures (for logs and JSON responses)."""
    s = completion.stats
    read = s.demand_bytes + s.prefetch_bytes + s.wasted_bytes
    return {
        "hit_rate": s.hit_rate,
        "hits": s.hits,
        "prefetch_hits": s.prefetch_hits,
        "misses": s.misses,
        "stall_s": s.stall_s,
        "bytes_read": read,
        "bytes_read_per_token": read / max(1, completion.completion_tokens),
        "prefetch_exact_match": s.exact_match,
    }
