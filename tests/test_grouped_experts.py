"""Several experts of a layer in grouped kernel calls (``model.grouped_experts``, ``quant.native.gemm_grouped``): each
expert's output has the bits of its own call, whatever the rows, dtype, layout or threads; a provider's groups (the
scheduler: cache hits together, then reads as they land) feed them; and an engine's logits do not change."""

from __future__ import annotations

import pytest
import torch
from _native_experts import decode_steps, native_expert
from fate_edge.quant import QuantSpec
from fate_edge.quant.linear import QuantizedLinear
from fate_edge.quant.native import gemm_grouped, native_status

from fate_edge.model import grouped_experts
from fate_edge.model.experts import ExpertWeights, QuantizedExpert
from fate_edge.model.grouped_experts import GROUP_MAX_ROWS, compute_group, group_rows, groupable
from fate_edge.model.layer_step import ExpertInput

pytestmark = pytest.mark.skipif(not native_status()[0], reason=f"native int4 kernel: {native_status()[1]}")

SPEC = QuantSpec(4, 64)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fused", [True, False], ids=["gate-up-fused", "gate-up-apart"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_expert_gets_the_bits_of_its_own_call(threads, fused, dtype):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        experts = [native_expert(i, fused=fused) for i in range(5)]
        rows = [1, 3, 1, 2, 8]  # the row kernel and the tiled GEMM both
        g = torch.Generator().manual_seed(9)
        items = [(e, torch.randn(m, 256, generator=g).to(dtype)) for e, m in zip(experts, rows)]
        assert groupable(items)
        outs = compute_group(items)
        for (expert, x), y in zip(items, outs):
            assert y.dtype == dtype and y.shape == x.shape
            assert torch.equal(y, expert(x))
    finally:
        torch.set_num_threads(before)


def test_only_native_experts_of_one_shape_and_dtype_are_grouped():
    a, b = native_expert(0), native_expert(1)
    x = torch.randn(2, 256)
    assert groupable([(a, x), (b, x)])
    assert not groupable([(a, x)])  # one expert: its own call
    assert not groupable([(a, x), (native_expert(2, fused=False), x)])  # gate_up beside gate and up
    assert not groupable([(a, x), (native_expert(3, inter=256), x)])  # another intermediate size
    assert not groupable([(a, x), (b, x.bfloat16())])  # another dtype
    assert not groupable([(a, x), (b, x[:0])])  # no rows
    many = torch.randn(GROUP_MAX_ROWS, 256)
    assert groupable([(a, many[:32]), (b, many[32:])])
    assert not groupable([(a, many), (b, x)])  # a prompt chunk's rows: one call each, memory as before
    torch_kernel = QuantizedExpert(
        *(QuantizedLinear.from_float(torch.randn(128, 256), SPEC, kernel="torch-int4") for _ in range(2)),
        QuantizedLinear.from_float(torch.randn(256, 128), SPEC, kernel="torch-int4"),
    )
    assert not groupable([(a, x), (torch_kernel, x)])
    dense = ExpertWeights(torch.randn(128, 256), torch.randn(128, 256), torch.randn(256, 128))
    assert not groupable([(a, x), (dense, x)])


def test_group_rows_falls_back_to_one_call_each_and_leaves_skipped_experts_out():
    dense = {e: ExpertWeights(torch.randn(8, 16), torch.randn(8, 16), torch.randn(16, 8)) for e in (1, 4)}
    rows = ExpertInput(torch.randn(5, 16), decode=False)
    parts = {1: slice(0, 2), 3: slice(2, 3), 4: slice(3, 5)}
    out = group_rows([(1, dense[1]), (3, None), (4, dense[4])], rows, parts)
    assert sorted(out) == [1, 4]
    for e in (1, 4):
        assert torch.equal(out[e], dense[e](rows.h[parts[e]]))


def test_gemm_grouped_refuses_rows_that_do_not_fit():
    lin = QuantizedLinear.from_float(torch.randn(128, 256), SPEC, kernel="native-int4").native
    x = torch.randn(2, 256)
    with pytest.raises(ValueError, match="does not fit"):
        gemm_grouped([(lin, x, torch.empty(2, 64))])
    with pytest.raises(ValueError, match="contiguous"):
        gemm_grouped([(lin, torch.randn(256, 4).T, torch.empty(4, 128))])


@pytest.fixture(scope="module")
def native_model(tmp_path_factory):
    from _tiny_moe import build_wide_moe

    return build_wide_moe(tmp_path_factory.mktemp("wide") / "m", 128, vocab=1024)


def test_the_scheduler_hands_out_cache_hits_together_and_the_logits_do_not_change(native_model, monkeypatch, tmp_path):
    """In an engine with a budget the scheduler's first group holds every cached expert of a step; computing the
    groups in grouped kernel calls gives the logits the one-call-per-expert path gives, bit for bit."""
    from fate_edge import Engine
    from fate_edge.format.converted_stores import ensure_store
    from fate_edge.model.batch_step import Segment, forward_segments
    from fate_edge.runtime.engine_config import EngineConfig

    monkeypatch.setenv("FATE_EDGE_CACHE", str(tmp_path / "cache"))
    store = ensure_store(native_model, cold_bits=None, progress=False)
    prompts = [[3, 17, 99, 5, 250], [8, 61, 7], [40, 41, 42, 43], [900, 2]]
    groups: list[list[int]] = []
    grouped_calls: list[int] = []
    real_stream, real_compute = None, compute_group

    def counting_compute(items):
        grouped_calls.append(len(items))
        return real_compute(items)

    def run(grouping: bool) -> list[torch.Tensor]:
        nonlocal real_stream
        monkeypatch.setattr(grouped_experts, "compute_group", counting_compute)
        if not grouping:
            monkeypatch.setattr(grouped_experts, "groupable", lambda items: False)
        with Engine(EngineConfig(store, memory_budget="64MB", policy="lru", dtype="bfloat16")) as eng:
            real_stream = eng.model.experts.stream_groups

            def recording(layer, ids):
                for group in real_stream(layer, ids):
                    groups.append([e for e, _ in group])
                    yield group

            eng.model.experts.stream_groups = recording
            caches = [eng.model.new_cache() for _ in prompts]
            first = forward_segments(eng.model, [Segment(p, c) for p, c in zip(prompts, caches)])
            second = forward_segments(eng.model, [Segment([p[-1]], c) for p, c in zip(prompts, caches)])
        monkeypatch.undo()
        monkeypatch.setenv("FATE_EDGE_CACHE", str(tmp_path / "cache"))
        return [first, second]

    grouped = run(grouping=True)
    assert grouped_calls and max(grouped_calls) >= 2  # the decode step's cache hits went through grouped calls
    assert any(len(g) >= 2 for g in groups)
    grouped_calls.clear()
    alone = run(grouping=False)
    assert not grouped_calls
    for a, b in zip(grouped, alone):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fused", [True, False], ids=["gate-up-fused", "gate-up-apart"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_experts_with_biases_and_the_clamp_keep_their_own_bits(fused, dtype):
    """gpt-oss's experts (float32 biases on both matmuls, the clamped SwiGLU) grouped: each one's own bits; an
    expert without biases or with another activation is not grouped with them."""

    from fate_edge.model.experts import ExpertBias, Glu

    glu = Glu(1.0, 1.702)
    experts = []
    for i in range(4):
        e = native_expert(i, fused=fused)
        g = torch.Generator().manual_seed(100 + i)
        e.bias, e.glu = ExpertBias(torch.randn(256, generator=g), torch.randn(256, generator=g)), glu
        experts.append(e)
    g = torch.Generator().manual_seed(7)
    items = [(e, torch.randn(m, 256, generator=g).to(dtype)) for e, m in zip(experts, [1, 2, 5, 1])]
    assert groupable(items)
    for (expert, x), y in zip(items, compute_group(items)):
        assert torch.equal(y, expert(x))
    x = items[0][1]
    plain = native_expert(9, fused=fused)
    assert not groupable([(experts[0], x), (plain, x)])  # biases beside none
    plain.bias = experts[1].bias
    assert not groupable([(experts[0], x), (plain, x)])  # the clamp beside silu


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_shared_expert_in_the_experts_calls_keeps_its_own_bits(threads, dtype):
    """A shared expert (Qwen's: gate, up and its gate row in one matrix) computed in the routed experts' two grouped
    calls: its output and gate logit are the bits of shared_out, each routed expert's those of its own call."""
    import torch.nn.functional as F

    from fate_edge.model.grouped_experts import group_rows_with_shared, native_shared
    from fate_edge.model.layer import Fused
    from fate_edge.model.layer_step import shared_out

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(3)
        gate_up = QuantizedLinear.from_float(torch.randn(2 * 384 + 1, 256, generator=g), SPEC, kernel="native-int4")
        down = QuantizedLinear.from_float(torch.randn(256, 384, generator=g), SPEC, kernel="native-int4")
        mlp, dn = Fused(gate_up, None, [384, 384, 1]), Fused(down, None, [256])
        shared = native_shared(F.silu, mlp, dn)
        assert shared is not None
        group = [(e, native_expert(e)) for e in (4, 1, 7)]
        h = torch.randn(1, 256, generator=g).to(dtype)
        got = group_rows_with_shared(group, h, shared)
        assert got is not None
        outs, (z, gate) = got
        want_z, want_gate = shared_out(F.silu, h, mlp, dn)
        assert want_gate is not None and gate is not None
        assert torch.equal(z, want_z) and torch.equal(gate, want_gate)
        assert sorted(outs) == [1, 4, 7]
        for e, expert in group:
            assert torch.equal(outs[e], expert(h))
    finally:
        torch.set_num_threads(before)


def test_a_shared_expert_off_the_native_kernel_is_not_folded():
    import torch.nn.functional as F

    from fate_edge.model.grouped_experts import group_rows_with_shared, native_shared
    from fate_edge.model.layer import Fused

    g = torch.Generator().manual_seed(4)
    up_w, down_w = torch.randn(2 * 128, 256, generator=g), torch.randn(256, 128, generator=g)
    native_up = QuantizedLinear.from_float(up_w, SPEC, kernel="native-int4")
    native_down = QuantizedLinear.from_float(down_w, SPEC, kernel="native-int4")
    assert native_shared(F.silu, Fused(up_w, None, [128, 128]), Fused(native_down, None, [256])) is None  # a tensor
    bias = torch.zeros(256)
    assert native_shared(F.silu, Fused(native_up, bias, [128, 128]), Fused(native_down, None, [256])) is None
    shared = native_shared(F.silu, Fused(native_up, None, [128, 128]), Fused(native_down, None, [256]))
    assert shared is not None
    h = torch.randn(1, 256, generator=g)
    assert (
        group_rows_with_shared([(0, native_expert(0)), (1, native_expert(1, fused=False))], h, shared) is None
    )  # not groupable
    assert group_rows_with_shared([(0, None)], h, shared) is None  # every expert skipped


def _record_grouped_calls(monkeypatch) -> list[list[tuple[int, int]]]:
    """Each grouped stage from here on, as the shapes of its matrices in order (the calls still run): a
    ``gemm_grouped`` call, or each of the two stages of a ``glu_grouped`` call (bf16 SiLU-gated experts: gate and
    up, then down, in one call into the kernel)."""
    calls: list[list[tuple[int, int]]] = []
    real, real_glu = grouped_experts.gemm_grouped, grouped_experts.glu_grouped

    def recording(table):
        calls.append([lin.shape for lin, _, _ in table])
        real(table)

    def recording_glu(first, glu, down):
        for rows in (first, down):  # 13 integers a matrix: N and K at 4 and 5
            calls.append([(rows[i + 4], rows[i + 5]) for i in range(0, len(rows), 13)])
        real_glu(first, glu, down)

    monkeypatch.setattr(grouped_experts, "gemm_grouped", recording)
    monkeypatch.setattr(grouped_experts, "glu_grouped", recording_glu)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_resident_decode_token_takes_its_shared_expert_into_the_experts_two_calls(tmp_path, dtype, monkeypatch):
    """A resident int4 model (shared expert int4 too): each MoE layer of a decode token makes two grouped kernel
    calls, the shared expert first in each beside the routed experts, and the logits are the bits of computing the
    shared expert on its own (a provider that is not all at hand)."""
    from _tiny_moe import build_wide_moe

    from fate_edge import load_model
    from fate_edge.model.experts import InMemoryExpertProvider
    from fate_edge.runtime.loader import expert_spec

    model = load_model(build_wide_moe(tmp_path / "m", 128, vocab=1024), dtype, resident_bits=4)
    _without_whole_layers(monkeypatch)
    spec = expert_spec(model.config, 4)
    model.experts = InMemoryExpertProvider.quantized(model.experts, spec, kernel="native-int4")
    calls = _record_grouped_calls(monkeypatch)

    def decode() -> list[torch.Tensor]:
        return decode_steps(model, after_prompt=calls.clear)

    folded = decode()
    moe_layers = sum(lp.router is not None for lp in model.plan())
    assert len(calls) == 2 * moe_layers * 3  # gate and up, then down: the shared expert in both
    assert all(len(c) == 1 + model.config.num_experts_per_tok for c in calls)
    assert calls[0][0] == (2 * 128 + 1, 128) and calls[1][0] == (128, 128)  # the shared expert first
    monkeypatch.setattr(InMemoryExpertProvider, "all_at_hand", False)
    apart = decode()
    assert all(len(c) == model.config.num_experts_per_tok for c in calls)
    for a, b in zip(folded, apart):
        assert torch.equal(a, b)


def test_an_engine_whose_budget_holds_the_model_folds_the_shared_expert_like_the_resident_model(tmp_path, monkeypatch):
    """The default engine on a model its budget holds: once an expert has been read it stays, so a warm decode
    token's MoE layer makes the resident model's two grouped calls with the shared expert in them, with the bits of
    an engine whose budget holds only some experts (each expert read when it misses, the shared expert apart)."""
    from _tiny_moe import build_wide_moe

    from fate_edge.format.convert import convert
    from fate_edge.runtime.engine import Engine
    from fate_edge.runtime.engine_config import EngineConfig
    from fate_edge.runtime.generate import GenerateConfig

    store = convert(build_wide_moe(tmp_path / "m", 128, vocab=1024), tmp_path / "s", progress=False)
    calls = _record_grouped_calls(monkeypatch)
    _without_whole_layers(monkeypatch)
    cfg = GenerateConfig(max_tokens=12, ignore_eos=True, logprobs=3)
    prompt = [3, 17, 99, 5, 250, 7, 64, 12]
    runs = {}
    for budget in ("auto", 150_000):  # every expert, or 3 and 2 of each layer's 4
        with Engine(EngineConfig(store, budget, dtype="bfloat16")) as engine:
            calls.clear()
            runs[budget] = [(r.token, r.logprob) for r in engine.stream(prompt, cfg)]
            whole = engine.model.experts.all_at_hand
            stats = engine.scheduler.stats
            folded = [c for c in calls if c[0] == (2 * 128 + 1, 128)]  # the shared expert's gate, up and gate logit
        if budget == "auto":  # after the first tokens' reads, every decode token's two layers
            assert whole and len(folded) >= 2 * (cfg.max_tokens - 4)
            assert all(len(c) > 1 for c in folded)  # beside routed experts' matrices
            assert stats.predict_s == 0 and stats.predictions_skipped > 0  # nothing left to predict a read for
        else:
            assert not whole and not folded
            assert stats.predict_s > 0  # the predictor runs where experts are read
    assert runs["auto"] == runs[150_000]  # tokens and logprobs: the same bits


def _without_whole_layers(monkeypatch) -> None:
    """Resident layers run whole in one native call (decode_layer, tests/test_decode_layer.py); this file checks the
    step-by-step path beside it (taken where that call is not: a full KV cache, a router tie, a busy provider)."""
    from fate_edge.model.decode_layer import DecodeLayers

    monkeypatch.setattr(DecodeLayers, "of", staticmethod(lambda *args: None))
