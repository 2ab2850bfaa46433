"""gpt-oss's MXFP4 experts of a layer in grouped kernel calls (``quant.mxfp4.gemm_grouped`` through
``model.grouped_experts``): each expert's output has the bits of its own call on every path, rows, dtype and thread
count; the grouped kernel refuses what it cannot take; int4 and MXFP4 experts never share a group."""

from __future__ import annotations

import pytest
import torch
from fate_edge.quant import QuantSpec
from fate_edge.quant.linear import QuantizedLinear
from fate_edge.quant.mxfp4 import Mxfp4Linear, gemm_grouped, native_mxfp4_status, quantize_mxfp4
from fate_edge.quant.native import native_status

from fate_edge.model.experts import ExpertBias, Glu, QuantizedExpert
from fate_edge.model.grouped_experts import compute_group, groupable, native_stages

pytestmark = pytest.mark.skipif(not native_mxfp4_status()[0], reason=f"mxfp4 kernel: {native_mxfp4_status()[1]}")

GPT_OSS = Glu(limit=7.0)


def _expert(seed: int, hidden: int = 192, inter: int = 96, fused: bool = True, bias: bool = True) -> QuantizedExpert:
    g = torch.Generator().manual_seed(seed)
    mats = [torch.randn(inter, hidden, generator=g), torch.randn(inter, hidden, generator=g)]
    mats.append(torch.randn(hidden, inter, generator=g))
    lins = [Mxfp4Linear(*quantize_mxfp4(w * 0.05)) for w in mats]
    b = ExpertBias(torch.randn(2 * inter, generator=g), torch.randn(hidden, generator=g)) if bias else None
    expert = QuantizedExpert(*lins, None, b, GPT_OSS)
    return expert.fused() if fused else expert


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fused", [True, False], ids=["gate-up-fused", "gate-up-apart"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_mxfp4_expert_gets_the_bits_of_its_own_call(threads, fused, dtype):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        experts = [_expert(i, fused=fused) for i in range(5)]
        rows = [1, 3, 1, 2, 9]  # the one- and two-row paths and the many-row one
        g = torch.Generator().manual_seed(9)
        items = [(e, torch.randn(m, 192, generator=g).to(dtype)) for e, m in zip(experts, rows)]
        assert groupable(items)
        outs = compute_group(items)
        for (expert, x), y in zip(items, outs):
            assert y.dtype == dtype and y.shape == x.shape
            assert torch.equal(y, expert(x))
    finally:
        torch.set_num_threads(before)


def test_mxfp4_groups_hold_one_kind_and_shape():
    a, b = _expert(0), _expert(1)
    x = torch.randn(2, 192)
    assert native_stages(a) is not None and groupable([(a, x), (b, x)])
    assert not groupable([(a, x), (_expert(2, inter=64), x)])  # another intermediate size
    assert not groupable([(a, x), (_expert(3, bias=False), x)])  # biases on one only
    assert not groupable([(a, x), (b, x.bfloat16())])  # another dtype
    dq = _expert(4)
    assert dq.gate_up is not None
    dq.gate_up = Mxfp4Linear(dq.gate_up.blocks, dq.gate_up.scales, "dequant")
    assert native_stages(dq) is None and not groupable([(a, x), (dq, x)])  # off the native kernel
    spec, m = QuantSpec(4, 64), _expert(5, hidden=256, inter=128)
    int4 = QuantizedExpert(
        *(QuantizedLinear.from_float(torch.randn(s), spec, kernel="native-int4") for s in ((128, 256),) * 2),
        QuantizedLinear.from_float(torch.randn(256, 128), spec, kernel="native-int4"),
        None,
        m.bias,
        GPT_OSS,
    ).fused()
    x = torch.randn(2, 256)
    if native_status()[0]:  # the int4 kernel is built here: same shapes, still never one group
        assert native_stages(int4) is not None
        assert groupable([(m, x), (_expert(6, hidden=256, inter=128), x)]) and not groupable([(m, x), (int4, x)])


def test_grouped_kernel_refuses_what_it_cannot_take():
    lin = Mxfp4Linear(*quantize_mxfp4(torch.randn(64, 128)))
    x, y = torch.randn(2, 128), torch.empty(2, 64)
    with pytest.raises(ValueError, match=r"must be a contiguous \[M, 128\]"):
        gemm_grouped([(lin, torch.randn(2, 96), y)])
    with pytest.raises(ValueError, match=r"does not fit x"):
        gemm_grouped([(lin, x, torch.empty(2, 64, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match=r"on the 'dequant' kernel"):
        gemm_grouped([(Mxfp4Linear(lin.blocks, lin.scales, "dequant"), x, y)])
    gemm_grouped([(lin, x, y), (lin, x[:0], y[:0])])  # rows-less calls are left out
    assert torch.equal(y, lin(x))
