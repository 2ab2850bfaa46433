"""A MoE layer's SiLU-gated experts in one call into the native kernel (``quant.native.glu_grouped``): the
activation between the stages has the bits of torch's ``F.silu(gate) * up`` on every bf16 input, special values and
row tails included, on each instruction set the host has; a group of experts has the bits of the two grouped calls
with torch between them; and groups the call does not take still compute through torch."""

from __future__ import annotations

import array

import pytest
import torch
import torch.nn.functional as F
from _native_experts import native_expert
from fate_edge.quant import QuantSpec, native

from fate_edge.model import grouped_experts
from fate_edge.model.grouped_experts import compute_group

pytestmark = pytest.mark.skipif(
    not native.native_status()[0], reason=f"native int4 kernel: {native.native_status()[1]}"
)

SPEC = QuantSpec(4, 64)
EVERY_BF16 = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, any NaN equal to any NaN (torch's scalar and vector paths quiet a NaN differently)."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a.view(torch.int16)[~nan], b.view(torch.int16)[~nan])


@pytest.mark.parametrize("offset", [0, 1, 3, 7, 13])
def test_torchs_bf16_silu_of_a_value_is_the_same_wherever_it_sits(offset):
    """What the kernel's table rests on: torch's bf16 silu of each of the 65,536 values, computed in a tensor at an
    offset (so each value meets another lane of torch's vector loop, and the tail), equals the table's entry."""
    shifted = torch.cat([torch.zeros(offset, dtype=torch.bfloat16), EVERY_BF16])[offset:]
    table = native.silu_table()[:65536].view(torch.bfloat16)
    assert _same_bits(F.silu(torch.cat([torch.ones(offset, dtype=torch.bfloat16), shifted]))[offset:], table)


def _glu_only(gate: torch.Tensor, up: torch.Tensor, isa: int) -> torch.Tensor:
    """fe_int4_glu_grouped's activation alone (no matrices) on gate and up views [M, I] sharing a row stride."""
    act = torch.empty(gate.shape, dtype=torch.bfloat16)
    glu = array.array("q", [gate.data_ptr(), up.data_ptr(), gate.stride(0), gate.shape[1], gate.shape[0]])
    glu.append(act.data_ptr())
    empty = array.array("q", [0] * 13)
    rc = native._lib().fe_int4_glu_grouped(
        0, empty.buffer_info()[0], 1, glu.buffer_info()[0], 0, empty.buffer_info()[0],
        native.silu_table().data_ptr(), 1, isa,
    )  # fmt: skip
    assert rc == 0
    return act


def _isas() -> list[int]:
    best = native._lib().fe_int4_isa()
    return [i for i in (2, 1, 0) if i <= best]  # AVX-512, AVX2, the scalar loop: each one this host can run


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("inter", [1, 7, 16, 37, 128])
def test_the_activation_has_torchs_bits_on_every_value_and_tail(isa, inter):
    """Gate and up drawn from every bf16 value (infinities, NaNs, subnormals, products that overflow or vanish),
    three rows of [gate | up] and rows of gate and up apart: the kernel's activation equals torch's
    ``F.silu(gate) * up`` bit for bit, at widths with and without a vector tail."""
    g = torch.Generator().manual_seed(inter)
    rows = 3
    pick = torch.randint(0, 65536, (rows, 2 * inter), generator=g)
    joined = EVERY_BF16[pick].contiguous()  # each row [gate | up]
    gate, up = joined[:, :inter], joined[:, inter:]
    want = F.silu(gate) * up
    assert _same_bits(_glu_only(gate, up, isa), want)
    apart = EVERY_BF16[torch.randint(0, 65536, (2, rows, inter), generator=g)]
    assert _same_bits(_glu_only(apart[0], apart[1], isa), F.silu(apart[0]) * apart[1])


def test_every_pair_of_a_bf16_gate_and_a_few_ups_matches_torch():
    """Each of the 65,536 gate values against ups of every magnitude: the table and the rounding of the product."""
    ups = EVERY_BF16[torch.tensor([0x3F80, 0xBF80, 0x4B00, 0x0080, 0x0001, 0x7F7F, 0x3F81, 0xC2F7])]
    for u in ups:
        gate, up = EVERY_BF16.view(256, 256), u.expand(256, 256)
        assert _same_bits(_glu_only(gate, up.contiguous(), native._lib().fe_int4_isa()), F.silu(gate) * up)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fused", [True, False], ids=["gate-up-fused", "gate-up-apart"])
def test_a_bf16_group_takes_one_call_with_the_bits_of_the_two_grouped_calls(threads, fused, monkeypatch):
    """A group of bf16 SiLU-gated int4 experts on rows of 1 to 8 goes through ``glu_grouped`` once, and every
    expert's output equals the path through two grouped calls with torch's activation between them."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(5)
        items = [
            (native_expert(i, fused=fused), torch.randn(m, 256, generator=g).bfloat16())
            for i, m in enumerate([1, 3, 8])
        ]
        seen = []
        real = grouped_experts.glu_grouped
        monkeypatch.setattr(grouped_experts, "glu_grouped", lambda *a: (seen.append(a), real(*a)))
        fused_out = compute_group(items)
        assert len(seen) == 1
        monkeypatch.setattr(grouped_experts, "_fusable", lambda *a: False)
        two_calls = compute_group(items)
        assert len(seen) == 1
        for (expert, x), a, b in zip(items, fused_out, two_calls):
            assert torch.equal(a, b) and torch.equal(a, expert(x))
    finally:
        torch.set_num_threads(before)


def test_groups_the_call_does_not_take_still_compute_through_torch(monkeypatch):
    """fp32 rows and the clamped SwiGLU (gpt-oss) are not the kernel's SiLU on bf16: no ``glu_grouped`` call."""
    from fate_edge.model.experts import Glu

    monkeypatch.setattr(grouped_experts, "glu_grouped", lambda *a: pytest.fail("glu_grouped called"))
    experts = [native_expert(i) for i in range(2)]
    x = torch.randn(2, 256)
    for (expert, rows), y in zip([(e, x) for e in experts], compute_group([(e, x) for e in experts])):
        assert torch.equal(y, expert(rows))
    for e in experts:
        e.glu = Glu(limit=7.0)
    xb = x.bfloat16()
    for expert, y in zip(experts, compute_group([(e, xb) for e in experts])):
        assert torch.equal(y, expert(xb))


def test_glu_grouped_refuses_tables_that_are_not_whole_rows():
    with pytest.raises(ValueError, match="whole rows"):
        native.glu_grouped([0] * 13, [0] * 5, [0] * 13)
    with pytest.raises(ValueError, match="none empty"):
        native.glu_grouped([], [], [])


def test_the_table_is_built_on_the_cpu_under_another_default_device(monkeypatch):
    """A script that runs under ``with torch.device("meta"):`` (as some loaders do) gets the same bits: the table
    of SiLU values is built on the CPU whatever the default device is, the first time inside that context."""
    monkeypatch.setattr(native, "_silu_table", [])
    g = torch.Generator().manual_seed(11)
    items = [(native_expert(i), torch.randn(2, 256, generator=g).bfloat16()) for i in range(3)]
    with torch.device("meta"):
        outs = compute_group(items)
    assert native.silu_table().device.type == "cpu"
    for (expert, x), y in zip(items, outs):
        assert torch.equal(y, expert(x))
