"""Kernel choice by row count: resident int4 matrices and experts are timed at a decode token (1 row) and at a
prefill chunk's rows; a kernel replaces the default only if it wins one and does not lose the other. Timings are
seeded here (no timing assertions): the contract is the rule and that the choice is recorded and used."""

import pytest
import torch
from fate_edge.quant import QuantSpec
from fate_edge.quant.linear import KERNEL_CHOICES, KERNEL_TIMINGS, pick_for_rows
from fate_edge.quant.ort import ort_available

from fate_edge import load_model
from fate_edge.fused import RESIDENT_ROWS, resident_int4_kernel

SPEC = QuantSpec(4, 32)


def test_a_prefill_win_may_not_cost_decode():
    one, many = {"torch-int4": 100.0, "ort-int4": 95.0}, {"torch-int4": 900.0, "ort-int4": 400.0}
    assert pick_for_rows([one, many]) == "ort-int4"  # ties at one row (within 10%), wins at many
    assert pick_for_rows([{"torch-int4": 100.0, "ort-int4": 125.0}, many]) == "torch-int4"  # decode 25% slower
    assert pick_for_rows([one, {"torch-int4": 900.0, "ort-int4": 850.0}]) == "torch-int4"  # no win past the margin
    assert pick_for_rows([{"torch-int4": 100.0, "ort-int4": 50.0}]) == "ort-int4"  # one row: pick_fastest's rule


@pytest.mark.skipif(not ort_available(), reason="onnxruntime is a runtime dependency; absent only in broken installs")
@pytest.mark.parametrize(("ort_us", "want"), [((95.0, 400.0), "ort-int4"), ((125.0, 400.0), "torch-int4")])
def test_resident_kernel_is_the_recorded_choice_at_decode_and_prefill_rows(ort_us, want):
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    base = (4, (64, 96), "cpu", torch.get_num_threads())
    one, many = ort_us
    KERNEL_TIMINGS[base] = {"torch-int4": 100.0, "ort-int4": one}
    KERNEL_TIMINGS[(*base, RESIDENT_ROWS[1])] = {"torch-int4": 900.0, "ort-int4": many}
    try:
        assert resident_int4_kernel(w, SPEC) == want
        assert resident_int4_kernel(w, SPEC, lm_head=True) == "torch-int4"  # the lm_head is never re-timed
    finally:
        KERNEL_TIMINGS.pop(base)
        KERNEL_TIMINGS.pop((*base, RESIDENT_ROWS[1]))


@pytest.mark.skipif(not ort_available(), reason="onnxruntime is a runtime dependency; absent only in broken installs")
def test_a_shape_torch_int4_cannot_take_gets_onnxruntime_not_int8(tmp_path, one_thread):
    """Qwen's shared expert gate_up carries its gate row (N = 2I + 1, not a multiple of 16): torch's int4 kernel
    cannot take it and it fell back to int8 (the slowest matmul of a Qwen prefill at M=64); 4 bits were asked."""
    from _tiny_moe import build_tiny_moe

    d = build_tiny_moe(tmp_path / "tiny", expert_dim=32)  # shared expert intermediate 32: gate_up N = 65
    model = load_model(d, torch.bfloat16, resident_bits=4)
    moe = next(lp for lp in model.plan() if lp.router is not None)
    assert moe.mlp.sizes == [32, 32, 1] and moe.mlp.weight.kernel == "ort-int4"
    assert KERNEL_CHOICES[(4, (65, 32), "cpu")] == "ort-int4"
    ref = load_model(d, torch.bfloat16)
    ids = torch.tensor([[5, 30, 17, 200, 99, 100, 7, 64]])
    want, got = ref(ids, ref.new_cache()).float(), model(ids, model.new_cache()).float()
    assert (got - want).norm() / want.norm() < 0.15
