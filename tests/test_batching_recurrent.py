"""The batcher on models with recurrent layers: each sequence's convolution windows and DeltaNet matrices are its
own (outside the KV slab), drawn from the same KV budget, and every sequence's greedy text is what it gets alone."""

from __future__ import annotations

from pathlib import Path

import pytest
from _tiny_recurrent import build_tiny

from fate_edge import Engine, GenerateConfig
from fate_edge.runtime.memory_account import kv_bytes_per_token, state_bytes

PROMPTS = ["def main():\n", "import os\n", "class A:\n    def f(self):", "x = [1, 2, 3]\nfor i in x:"]


def _interleaved(engine: Engine, requests: list[tuple[str, GenerateConfig]]) -> list[str]:
    """Each stream opened after a token of every open one (joining a running batch), then all read round-robin."""
    streams, texts = [], []
    for prompt, cfg in requests:
        streams.append(engine.stream(prompt, cfg))
        texts.append([])
        for s, t in zip(streams, texts):
            step = next(s, None)
            if step is not None:
                t.append(step.text)
    open_ = list(range(len(streams)))
    while open_:
        for i in list(open_):
            step = next(streams[i], None)
            if step is None:
                open_.remove(i)
            else:
                texts[i].append(step.text)
    return ["".join(t) for t in texts]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["lfm2_moe", "qwen3_next"])
def test_batched_greedy_text_is_each_sequences_alone_within_the_kv_budget(arch: str, tmp_path: Path):
    path = tmp_path / arch
    build_tiny(arch, path)
    kw = dict(memory_budget="2MB", device="cpu", policy="fate-edge", dtype="float32", context_tokens=128)
    with Engine.load(path, max_batch=1, **kw) as alone, Engine.load(path, max_batch=3, **kw) as batched:
        c = batched.batcher.config
        cfg = batched.model.config
        assert c.state_bytes == state_bytes(cfg, batched.dtype) > 0
        assert c.kv_bytes_per_token == kv_bytes_per_token(cfg, batched.dtype)
        assert c.kv_budget_bytes == 128 * c.kv_bytes_per_token + c.state_bytes  # the account: one request's
        requests = [(p, GenerateConfig(max_tokens=10 + 3 * i, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
        expected = [alone.generate_text(p, g)[0] for p, g in requests]
        assert _interleaved(batched, requests) == expected
        stats = batched.batcher.stats
        assert stats.sequences_stepped > stats.steps and stats.kv_reserved_bytes == 0
        slab = batched.batcher._slab
        assert slab is not None  # the slab is what the batch's states leave of the budget
        assert slab.positions == (c.kv_budget_bytes - c.max_batch * c.state_bytes) // c.kv_bytes_per_token


@pytest.mark.slow
def test_an_undone_step_restores_every_recurrent_state(tmp_path: Path):
    """One expert read fails in a step of several sequences: the batcher undoes the step (each cache back to its
    snapshot, the recurrent states copied back, not only the lengths) and runs it again one sequence at a time, so
    every text is still its alone text (a state advanced twice by the same rows would change it)."""
    import errno

    path = tmp_path / "lfm2"
    build_tiny("lfm2_moe", path)
    kw = dict(memory_budget="100KB", device="cpu", policy="fate-edge", dtype="float32", context_tokens=128)
    requests = [(p, GenerateConfig(max_tokens=12, ignore_eos=True)) for p in PROMPTS[:3]]
    with Engine.load(path, max_batch=1, **kw) as alone:
        expected = [alone.generate_text(p, g)[0] for p, g in requests]
    with Engine.load(path, max_batch=3, **kw) as batched:
        failed: list[int] = []

        def inject(ref):
            if not failed and len(batched.batcher._active) >= 2:
                failed.append(ref.layer)
                raise OSError(errno.EIO, "injected read error")

        batched.fetch.fault_injector = inject
        assert _interleaved(batched, requests) == expected
        assert failed, "no read failed in a step of several sequences"


@pytest.mark.slow
@pytest.mark.parametrize("max_batch", [1, 3], ids=["alone", "batched"])
@pytest.mark.parametrize("arch", ["lfm2_moe", "qwen3_next"])
def test_a_next_turn_starts_from_the_kept_recurrent_state_with_the_same_text(arch: str, max_batch: int, tmp_path):
    """The prompt cache keeps a finished request's convolution windows and DeltaNet matrices (a snapshot at its
    length, beside the attention layers' keys and values); the next turn starts from it, prefills only its new tokens
    and answers as a cold run does."""
    path = tmp_path / arch
    build_tiny(arch, path)
    kw = dict(memory_budget="2MB", device="cpu", policy="fate-edge", dtype="float32", context_tokens=128)
    config = GenerateConfig(max_tokens=6, ignore_eos=True)
    with Engine.load(path, max_batch=max_batch, **kw) as on, Engine.load(path, prompt_cache=0, **kw) as off:
        tok = on.tokenizer
        prompt = tok.encode(PROMPTS[2])
        first, _ = on.generate_text(prompt, config)
        assert first == off.generate_text(prompt, config)[0]
        stats = on.prompt_cache.stats
        assert stats.kept == 1 and stats.bytes_held > 0
        # the kept state holds the prompt and the answer bar its last token (never fed back)
        held = next(iter(on.prompt_cache._entries))
        follow = list(held) + tok.encode("\n    return 1\n")
        again, _ = on.generate_text(follow, config)
        assert stats.hits == 1 and stats.tokens_saved == len(held)
        assert again == off.generate_text(follow, config)[0]
