"""Kernel choice by row count (memory experts are timed at a decode token and at an expert's share of a prefill
chunk; a kernel replaces the default only if it wins one and does not lose the other), and the int4 resident
weights of shapes torch's int4 kernel takes only padded. Timings are seeded here (no timing assertions)."""

import pytest
import torch
from fate_edge.quant import QuantSpec
from fate_edge.quant.linear import KERNEL_CHOICES, KERNEL_TIMINGS, pick_for_rows
from fate_edge.quant.ort import ort_available

from fate_edge import load_model
from fate_edge.model.experts import EXPERT_ROWS, ExpertWeights, quantize_expert

SPEC = QuantSpec(4, 32)


def test_a_prefill_win_may_not_cost_decode():
    one, many = {"torch-int4": 100.0, "ort-int4": 95.0}, {"torch-int4": 900.0, "ort-int4": 400.0}
    assert pick_for_rows([one, many]) == "ort-int4"  # ties at one row (within 10%), wins at many
    assert pick_for_rows([{"torch-int4": 100.0, "ort-int4": 125.0}, many]) == "torch-int4"  # decode 25% slower
    assert pick_for_rows([one, {"torch-int4": 900.0, "ort-int4": 850.0}]) == "torch-int4"  # no win past the margin
    assert pick_for_rows([{"torch-int4": 100.0, "ort-int4": 50.0}]) == "ort-int4"  # one row: pick_fastest's rule


@pytest.mark.skipif(not ort_available(), reason="onnxruntime is a runtime dependency; absent only in broken installs")
@pytest.mark.parametrize(("ort_us", "want"), [((95.0, 400.0), "ort-int4"), ((125.0, 400.0), "torch-int4")])
def test_expert_kernel_is_the_recorded_choice_at_decode_and_prefill_rows(ort_us, want):
    g = torch.Generator().manual_seed(0)
    e = ExpertWeights.fused(torch.randn(128, 96, generator=g), torch.randn(96, 64, generator=g))
    keys = []
    for shape in ((128, 96), (96, 64)):  # gate_up, down
        base = (4, shape, "cpu", torch.get_num_threads())
        KERNEL_TIMINGS[base] = {"torch-int4": 100.0, "ort-int4": ort_us[0]}
        KERNEL_TIMINGS[(*base, EXPERT_ROWS[1])] = {"torch-int4": 900.0, "ort-int4": ort_us[1]}
        keys += [base, (*base, EXPERT_ROWS[1])]
    try:
        q = quantize_expert(e, SPEC)
        assert q.gate_up.kernel == q.down.kernel == want
        assert KERNEL_CHOICES[(4, (128, 96), "cpu")] == KERNEL_CHOICES[(4, (96, 64), "cpu")] == want
    finally:
        for k in keys:
            KERNEL_TIMINGS.pop(k)


def test_a_shape_torch_int4_takes_only_padded_stays_int4_not_int8(tmp_path, one_thread):
    """Qwen's shared expert gate_up carries its gate row (N = 2I + 1, not a multiple of 16): torch's int4 kernel
    could not take it and it fell back to int8 (the slowest matmul of a Qwen prefill at M=64, 3x the int4 time at
    the real shape); padded with zero rows it is int4, and the padded outputs never reach the model."""
    from _tiny_moe import build_tiny_moe

    d = build_tiny_moe(tmp_path / "tiny", expert_dim=32)  # shared expert intermediate 32: gate_up N = 65
    model = load_model(d, torch.bfloat16, resident_bits=4)
    moe = next(lp for lp in model.plan() if lp.router is not None)
    assert moe.mlp.sizes == [32, 32, 1] and moe.mlp.weight.kernel == "torch-int4"
    assert moe.mlp.weight.shape == (80, 32) and KERNEL_CHOICES[(4, (80, 32), "cpu")] == "torch-int4"
    assert model.kernels()["mlp"] == ["torch-int4"]  # shared experts and the dense layer's gate_up
    ref = load_model(d, torch.bfloat16)
    ids = torch.tensor([[5, 30, 17, 200, 99, 100, 7, 64]])
    want = ref(ids, ref.new_cache()).float()
    got = model(ids, model.new_cache()).float()
    assert (got - want).norm() / want.norm() < 0.15
    cache = model.new_cache()  # decode (layer_step.shared_out) splits the shared expert's outputs too
    model(ids[:, :4], cache)
    step = model(ids[:, 4:5], cache).float()
    assert (step[0, 0] - want[0, 4]).norm() / want[0, 4].norm() < 0.15


def test_a_run_of_some_sides_needs_only_their_ggufs():
    from fate_edge_lab.bench import sidebyside as sbs

    real = sbs.SIDE_SETS["real"]
    part = sbs.only_sides(real, ["fate-edge int4, int4 rest", "llama.cpp q4_0"])
    assert [s.name for s in part.resident] == ["fate-edge int4, int4 rest", "llama.cpp q4_0"]
    assert part.limited == [] and part.gguf_types == ("q4_0",)  # no bf16 GGUF to build
    assert part.pairs == [("fate-edge int4, int4 rest", "llama.cpp q4_0")]
    with pytest.raises(ValueError, match="no side"):
        sbs.only_sides(real, ["llama.cpp q8_0"])


def test_prefill_is_also_counted_in_cpu_time_which_waiting_does_not_spend():
    import time

    from fate_edge_lab.bench.llamacpp import time_tokens

    def waits_then_yields():
        time.sleep(0.05)  # a busy host's wait for a core: wall time, no CPU time
        yield from (1, 2)

    t = time_tokens(waits_then_yields(), n_prompt=8, want=2)
    assert t["prefill_cpu_tps"] > 4 * t["prefill_tps"] > 0


def test_decode_is_also_counted_in_cpu_time_which_waiting_does_not_spend():
    import time

    from fate_edge_lab.bench.llamacpp import time_tokens

    def yields_then_waits():
        yield 1
        for tok in (2, 3):
            time.sleep(0.05)  # waits between decode tokens, as for a core on a shared host
            yield tok

    t = time_tokens(yields_then_waits(), n_prompt=8, want=3)
    assert t["decode_cpu_tps"] > 4 * t["decode_tps"] > 0
    assert time_tokens(iter([1]), 4, 3).get("decode_cpu_tps") is None
