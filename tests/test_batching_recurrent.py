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
    # half the experts: steps read (a budget that holds the model reads it all at load)
    kw = dict(memory_budget="40KB", device="cpu", policy="fate-edge", dtype="float32", context_tokens=128)
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


@pytest.mark.parametrize("arch", ["lfm2_moe", "qwen3_next"])
def test_decode_rows_step_their_recurrent_states_as_one(arch: str, tmp_path: Path, monkeypatch):
    """A step's decode rows step each recurrent layer's states stacked, in one call (``RecurrentLayer.step_rows``),
    also beside a joining prompt's chunk: every logit and every state (convolution window, DeltaNet matrix) within
    fp32 1e-6 of stepping each sequence's state alone (``BatchState.stack_recurrent`` False), the states still each
    sequence's own."""
    import torch

    from fate_edge.model.batch_step import BatchState, Segment, forward_segments
    from fate_edge.model.kv_cache import RecurrentLayer
    from fate_edge.model.kv_slab import KVSlab
    from fate_edge.model.recurrent import recurrent_specs
    from fate_edge.runtime.loader import load_model

    build_tiny(arch, tmp_path / arch)
    model = load_model(tmp_path / arch, dtype=torch.float32)
    prompts = [[(7 * j + 3 * i) % 4000 + 5 for i in range(n)] for j, n in enumerate((9, 5, 12, 7))]
    stacked: list[int] = []
    real = RecurrentLayer.step_rows
    monkeypatch.setattr(RecurrentLayer, "step_rows", lambda lays, x: stacked.append(len(lays)) or real(lays, x))
    runs = []
    for together in (True, False):
        monkeypatch.setattr(BatchState, "stack_recurrent", together)
        slab = KVSlab(model, 4 * 64)
        segs = [Segment(p, slab.allocate(64)) for p in prompts[:3]]
        logits = []
        for step in range(7):
            if step == 2:  # a prompt joins beside three decode rows: their rows picked out of the step
                segs.append(Segment(prompts[3], slab.allocate(64)))
            out = forward_segments(model, segs)
            logits.append(out)
            for j, seg in enumerate(segs):
                seg.ids = [(11 * step + 5 * j) % 4000 + 1]
        states = [
            [t.clone() for t in lay.buffers] for s in segs for lay in s.cache.layers if isinstance(lay, RecurrentLayer)
        ]
        runs.append((logits, states))
    layers = len(recurrent_specs(model.config))
    assert stacked and set(stacked) == {3, 4} and len(stacked) == 6 * layers  # decode steps only, every layer
    (ours, our_states), (alone, alone_states) = runs
    for a, b in zip(ours, alone):
        assert (a - b).abs().max().item() <= 1e-6
    assert len(our_states) == len(alone_states) == 4 * layers
    for a_lay, b_lay in zip(our_states, alone_states):
        assert len(a_lay) == len(b_lay) > 0
        assert all((a - b).abs().max().item() <= 1e-6 for a, b in zip(a_lay, b_lay))
        assert all(a.shape[0] == 1 for a in a_lay)  # each sequence's own row
