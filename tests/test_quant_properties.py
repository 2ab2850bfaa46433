"""Properties of quant/: packing is lossless, RTN is within half a step, HQQ beats RTN, kernels agree."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("hypothesis")
from fate_edge.quant import QuantSpec, dequantize, pack, quantize, unpack  # noqa: E402
from fate_edge.quant.hqq import quantize_hqq  # noqa: E402
from fate_edge.quant.linear import QuantizedLinear  # noqa: E402
from fate_edge.quant.methods import METHODS, quantize_with  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FAST = settings(max_examples=40, deadline=None)


def _randn(shape, seed: int, std: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * std


# ---------------------------------------------------------------- packing
@FAST
@given(
    bits=st.sampled_from([8, 4, 3, 2]),
    lead=st.lists(st.integers(1, 5), min_size=0, max_size=2),
    units=st.integers(1, 24),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_unpack_identity(bits, lead, units, seed):
    storage = 4 if bits == 3 else bits  # 3-bit codes live in 4-bit slots
    k = units * (8 // storage)
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (*lead, k), generator=gen, dtype=torch.uint8)
    packed = pack(codes, storage)
    assert packed.dtype == torch.uint8 and packed.shape == (*lead, k * storage // 8)
    assert torch.equal(unpack(packed, storage), codes)


# ------------------------------------------------------------------- RTN
@FAST
@given(
    bits=st.sampled_from([8, 4, 3, 2]),
    group=st.sampled_from([32, 64, 128]),
    asym=st.booleans(),
    rows=st.integers(1, 6),
    groups=st.integers(1, 3),
    log_std=st.floats(-3.0, 2.0),  # weight scales from 1e-3 to 1e2
    offset=st.floats(-2.0, 2.0),  # in units of the std: groups away from zero
    seed=st.integers(0, 2**31 - 1),
)
def test_rtn_error_within_half_a_step(bits, group, asym, rows, groups, log_std, offset, seed):
    spec = QuantSpec(bits, group, asym)
    std = 10.0**log_std
    w = _randn((rows, groups * group), seed, std) + offset * std
    q = quantize(w, spec)
    assert q.codes.dtype == torch.uint8 and int(q.codes.max()) <= spec.qmax
    err = (w - dequantize(q, spec)).abs().reshape(rows, groups, group)
    # Half a step from the rounding, plus a few fp32 ulps of the group's largest value for the arithmetic.
    ulps = 4 * torch.finfo(torch.float32).eps * w.abs().reshape(rows, groups, group).amax(dim=-1)
    assert torch.all(err.amax(dim=-1) <= q.scale.float() / 2 * (1 + 1e-5) + ulps)


# ------------------------------------------------------------------- HQQ
SEEDS = range(4)


@pytest.mark.parametrize("bits,group", [(4, 64), (3, 64), (2, 32), (2, 64)])
def test_hqq_beats_rtn_on_gaussian_weights(bits, group):
    """A statistical property, checked on fixed seeds: HQQ's mean |error| is below RTN's on every group
    (it starts from RTN and keeps a group's best iterate) and clearly below on average (~5-7%)."""
    spec = QuantSpec(bits, group)
    ratios = []
    for seed in SEEDS:
        w = _randn((64, 256), seed, 0.02)
        r, h = quantize(w, spec), quantize_hqq(w, spec)
        assert h.codes.dtype == torch.uint8 and int(h.codes.max()) <= spec.qmax
        assert torch.equal(h.scale, r.scale) and h.zero.dtype == torch.float16 and torch.isfinite(h.zero).all()
        err_r = (w - dequantize(r, spec)).abs().reshape(64, -1, group).mean(dim=-1)
        err_h = (w - dequantize(h, spec)).abs().reshape(64, -1, group).mean(dim=-1)
        assert torch.all(err_h <= err_r * (1 + 1e-6))
        ratios.append(float(err_h.mean() / err_r.mean()))
    assert sum(ratios) / len(ratios) < 0.97, ratios


def test_hqq_is_scale_invariant_and_keeps_constant_groups_exact():
    spec = QuantSpec(4, 64)
    w = _randn((8, 128), 0, 0.02)
    w[0, :64] = 0.125
    a, b = quantize_hqq(w, spec), quantize_hqq(w * 64.0, spec)  # a power of two: exact in fp16 too
    assert torch.equal(a.codes, b.codes)
    assert (dequantize(a, spec) - w)[0, :64].abs().max() == 0


def test_methods_dispatch():
    w = _randn((16, 64), 1)
    spec = QuantSpec(2, 32)
    assert set(METHODS) == {"rtn", "hqq"}
    assert torch.equal(quantize_with("rtn", w, spec).codes, quantize(w, spec).codes)
    assert torch.equal(quantize_with("hqq", w, spec).zero, quantize_hqq(w, spec).zero)
    with pytest.raises(ValueError, match="rtn"):
        quantize_with("gptq", w, spec)


# --------------------------------------------------------------- kernels
@settings(max_examples=25, deadline=None)
@given(
    bits=st.sampled_from([4, 3, 2]),
    group=st.sampled_from([32, 64, 128]),
    n16=st.integers(1, 8),
    groups=st.integers(1, 3),
    m=st.sampled_from([1, 3, 16]),
    method=st.sampled_from(METHODS),
    seed=st.integers(0, 2**31 - 1),
)
def test_int4_kernel_agrees_with_dequant(bits, group, n16, groups, m, method, seed):
    """torch-int4 (bf16 activations, bf16 scale/zero, fp32 accumulation) vs dequantize + fp32 matmul.

    The int4 kernel rounds x to bf16 (relative error <= 2**-9) and stores scale and zero' in bf16, where codes
    are centred in the slot (c' = c + shift, shift = 8 - 2**(bits-1)) and zero' = zero + (8 - shift) * scale;
    so each dequantized weight (c' - 8) * scale + zero' is off by <= 2**-9 * (|c' - 8| * scale + |zero'|).
    Summing |x_k| times both errors over k bounds every output's error; we allow twice that bound for
    accumulation order and fp32 rounding. (A relative bound would not do: an output that cancels to ~0
    over a short row has an arbitrarily large relative error; see the expert-shaped test below.)
    """
    spec = QuantSpec(bits, group)
    n, k = 16 * n16, group * groups
    w = _randn((n, k), seed, 0.05)
    x = _randn((m, k), seed + 1)
    q = quantize_with(method, w, spec)
    fast = QuantizedLinear.from_quantized(q, spec, kernel="torch-int4")
    ref = QuantizedLinear.from_quantized(q, spec, kernel="dequant")
    y, y_ref = fast(x), ref(x)
    assert y.dtype == x.dtype and y.shape == (m, n)
    w_hat = dequantize(q, spec)
    half = (spec.qmax + 1) // 2  # 8 - shift
    scale = q.scale.float().repeat_interleave(group, dim=-1)
    zero_p = (q.zero.float() + half * q.scale.float()).repeat_interleave(group, dim=-1)
    u = 2.0**-9
    bound = x.abs() @ (u * w_hat.abs() + u * ((q.codes.float() - half).abs() * scale + zero_p.abs())).T
    assert torch.all((y - y_ref).abs() <= 2 * bound + 1e-6)


@pytest.mark.parametrize("bits", [4, 3, 2])
@pytest.mark.parametrize("shape", [(128, 192), (192, 128)], ids=str)
def test_int4_kernel_relative_error_on_expert_shapes(bits, shape):
    """On the bundled model's expert shapes with 16 tokens, the bf16 rounding of x, scale and zero costs
    well under 1% of the output's RMS (independent roundings of ~2**-9 add in quadrature: ~0.3%). Without
    centring int2 codes in the slot, zero' = zero + 8 * scale is ~10x the weights and this was 2.4%."""
    spec = QuantSpec(bits, 64)
    q = quantize(_randn(shape, 7, 0.05), spec)
    x = _randn((16, shape[1]), 8)
    y, y_ref = (QuantizedLinear.from_quantized(q, spec, kernel=kern)(x) for kern in ("torch-int4", "dequant"))
    assert (y - y_ref).pow(2).mean().sqrt() < 0.01 * y_ref.pow(2).mean().sqrt()
