"""A decode row's routed experts and shared expert in one kernel call, summed into the residual by one native call
from the call's own buffer (``grouped_experts.fused_row_with_shared``, ``row_ops.add_expert_rows``): the bits of
computing them apart and summing them with torch's operators."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _native_experts import SPEC, decode_steps, native_expert
from fate_edge.quant.linear import QuantizedLinear
from fate_edge.quant.native import native_status

from fate_edge.model import grouped_experts, routed_experts, row_ops
from fate_edge.model.grouped_experts import FusedRow, fused_row_with_shared, group_rows_with_shared, native_shared
from fate_edge.model.layer import Fused
from fate_edge.model.layer_step import shared_out

pytestmark = pytest.mark.skipif(
    not (native_status()[0] and row_ops.available()[0]), reason="needs the native int4 and row kernels"
)


def _shared(gated: bool, hidden: int = 256, inter: int = 384):
    g = torch.Generator().manual_seed(11)
    rows = 2 * inter + int(gated)
    gate_up = QuantizedLinear.from_float(torch.randn(rows, hidden, generator=g), SPEC, kernel="native-int4")
    down = QuantizedLinear.from_float(torch.randn(hidden, inter, generator=g), SPEC, kernel="native-int4")
    sizes = [inter, inter, 1] if gated else [inter, inter]
    mlp, dn = Fused(gate_up, None, sizes), Fused(down, None, [hidden])
    shared = native_shared(F.silu, mlp, dn)
    assert shared is not None
    return shared, mlp, dn


def test_the_sigmoid_table_is_torchs_sigmoid_of_each_value_alone():
    """The table is made in one call over all 65,536 values; the decode step's gate is one value alone."""
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    alone = torch.cat([torch.sigmoid(every[i : i + 1].clone()) for i in range(65536)])
    assert torch.equal(row_ops.sigmoid_table(), alone.view(torch.int16))


@pytest.mark.parametrize("gated", [True, False])
def test_the_sum_from_addresses_has_the_bits_of_the_sum_from_tensors(gated):
    g = torch.Generator().manual_seed(5)
    for trial in range(30):
        n = (2048, 2047, 24, 5)[trial % 4]  # the vector loop, its tail, and a tail alone
        k = 1 + trial % 8
        x = (torch.randn(1, n, generator=g) * 3).bfloat16()
        ys = [(torch.randn(1, n, generator=g) * (1e-3, 1.0, 40.0)[trial % 3]).bfloat16() for _ in range(k)]
        ws = torch.rand(k, generator=g).tolist()
        z = torch.randn(1, n, generator=g).bfloat16()
        gate = (torch.randn(1, 1, generator=g) * 4).bfloat16() if gated else None
        want = x.clone()
        assert row_ops.add_experts(want, ys, ws, (z, gate))  # torch.sigmoid on the gate, then the sum
        got = x.clone()
        addresses = [y.data_ptr() for y in ys]
        assert row_ops.add_expert_rows(got, addresses, ws, z.data_ptr(), gate.data_ptr() if gated else None)
        assert torch.equal(got, want), f"trial {trial}"
    assert not row_ops.add_expert_rows(x.float(), addresses, ws, z.data_ptr(), None)  # a float32 row: not taken


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("gated", [True, False])
def test_a_fused_row_holds_each_experts_own_bits(threads, gated):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        shared, mlp, dn = _shared(gated)
        group = [(e, native_expert(e)) for e in (4, 1, 7, 30)]
        h = torch.randn(1, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
        row = fused_row_with_shared(group, h, shared)
        assert isinstance(row, FusedRow) and row.ids == [4, 1, 7, 30]
        outs, (z, gate) = row.tensors()
        want = group_rows_with_shared(group, h, shared)
        assert want is not None
        want_outs, (want_z, want_gate) = want
        for e, expert in group:
            assert torch.equal(outs[e], want_outs[e]) and torch.equal(outs[e], expert(h))
            assert outs[e].data_ptr() == row.outputs()[e]  # the addresses the native sum reads
        assert torch.equal(z, want_z)
        ref_z, ref_gate = shared_out(F.silu, h, mlp, dn)
        assert torch.equal(z, ref_z)
        if gated:
            assert gate is not None and want_gate is not None and ref_gate is not None
            assert torch.equal(gate, want_gate) and torch.equal(gate, ref_gate)
        else:
            assert gate is None and want_gate is None and ref_gate is None
    finally:
        torch.set_num_threads(before)


def test_rows_that_do_not_fuse_are_left_to_the_general_path():
    shared, _, _ = _shared(True)
    group = [(0, native_expert(0)), (1, native_expert(1))]
    h = torch.randn(1, 256).bfloat16()
    assert fused_row_with_shared(group, torch.randn(2, 256).bfloat16(), shared) is None  # two rows
    assert fused_row_with_shared(group, h.float(), shared) is None  # float32 rows: two grouped calls instead
    assert fused_row_with_shared([(0, native_expert(0)), (1, None)], h, shared) is None  # an expert skipped
    assert (
        fused_row_with_shared([(0, native_expert(0)), (1, native_expert(1, fused=False))], h, shared) is None
    )  # layouts differ


def test_a_resident_decode_sums_each_layer_from_the_kernels_buffer_with_the_same_bits(tmp_path, monkeypatch):
    """A resident bf16 int4 model: every MoE layer of a decode token sums its experts from the fused call's buffer in
    one native call; the logits are the bits of the same row through views (the native sum declining) and of the
    shared expert computed apart (a provider not all at hand)."""
    from _tiny_moe import build_wide_moe

    from fate_edge import load_model
    from fate_edge.model.experts import InMemoryExpertProvider
    from fate_edge.runtime.loader import expert_spec

    model = load_model(build_wide_moe(tmp_path / "m", 128, vocab=1024), torch.bfloat16, resident_bits=4)
    _without_whole_layers(monkeypatch)
    model.experts = InMemoryExpertProvider.quantized(model.experts, expert_spec(model.config, 4), kernel="native-int4")
    sums = []
    real = routed_experts.add_expert_rows

    def counted(*args):
        done = real(*args)
        sums.append(done)
        return done

    monkeypatch.setattr(routed_experts, "add_expert_rows", counted)

    def decode() -> list[torch.Tensor]:
        return decode_steps(model, after_prompt=sums.clear)

    fused = decode()
    moe_layers = sum(lp.router is not None for lp in model.plan())
    assert sums == [True] * (3 * moe_layers)
    monkeypatch.setattr(routed_experts, "add_expert_rows", lambda *args: False)
    through_views = decode()
    monkeypatch.setattr(InMemoryExpertProvider, "all_at_hand", False)
    monkeypatch.setattr(grouped_experts, "fused_row_with_shared", lambda *args: pytest.fail("not all at hand"))
    apart = decode()
    for a, b, c in zip(fused, through_views, apart):
        assert torch.equal(a, b) and torch.equal(a, c)


def _without_whole_layers(monkeypatch) -> None:
    """Resident layers run whole in one native call (decode_layer, tests/test_decode_layer.py); this file checks the
    step-by-step path beside it (taken where that call is not: a full KV cache, a router tie, a busy provider)."""
    from fate_edge.model.decode_layer import DecodeLayers

    monkeypatch.setattr(DecodeLayers, "of", staticmethod(lambda *args: None))
