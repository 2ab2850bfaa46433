"""quant/: RTN round trip error, pack/unpack identity, byte accounting."""

import pytest
import torch
from fate_edge.quant import QuantSpec, bytes_per_weight, dequantize, pack, quantize, tensor_nbytes, unpack

SPECS = [QuantSpec(b, g, a) for b in (8, 4, 3, 2) for g in (32, 64, 128) for a in (True, False)]


def _weights(shape=(24, 256), seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen) * 0.02
    w[0, :64] += 3.0  # a group far from zero: the fp16 zero must not cost more than half a step
    w[1, :128] = 0.125  # a constant group
    w[2, 5] = 0.4  # an outlier
    return w


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_round_trip_error_within_half_a_step(spec: QuantSpec):
    w = _weights()
    q = quantize(w, spec)
    assert q.codes.dtype == torch.uint8 and q.codes.shape == w.shape
    assert int(q.codes.max()) <= spec.qmax
    assert q.scale.dtype == torch.float16 and q.scale.shape == (24, 256 // spec.group_size)
    assert (q.zero is None) == (not spec.asymmetric)
    err = (w - dequantize(q, spec)).abs().reshape(24, -1, spec.group_size).amax(dim=-1)
    # Bound from the rounding itself (fp32 arithmetic adds at most a few ulps).
    assert torch.all(err <= q.scale.float() / 2 * (1 + 1e-5) + 1e-7)
    if spec.asymmetric:
        assert err[1, 0] == 0  # a constant group is its own zero: exact


def test_error_shrinks_with_bits():
    w = _weights()
    errs = [(w - dequantize(quantize(w, QuantSpec(b, 64)), QuantSpec(b, 64))).abs().mean() for b in (2, 3, 4, 8)]
    assert errs[0] > errs[1] > errs[2] > errs[3]


def test_asymmetric_uses_full_code_range():
    w = torch.linspace(-1.0, 3.0, 64)[None]
    q = quantize(w, QuantSpec(4, 64))
    assert int(q.codes.min()) == 0 and int(q.codes.max()) == 15


def test_rejects_bad_shapes_and_specs():
    with pytest.raises(ValueError, match="group_size"):
        quantize(torch.zeros(4, 48), QuantSpec(4, 32))
    with pytest.raises(ValueError):
        QuantSpec(bits=5)
    with pytest.raises(ValueError):
        QuantSpec(group_size=16)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_pack_unpack_identity(bits: int):
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (3, 5, 64), generator=gen, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 64 * bits // 8)
    assert torch.equal(unpack(packed, bits), codes)


def test_pack_layout_is_little_endian_within_a_byte():
    assert pack(torch.tensor([[1, 2]], dtype=torch.uint8), 4).tolist() == [[0x21]]
    assert pack(torch.tensor([[3, 0, 1, 2]], dtype=torch.uint8), 2).tolist() == [[0b10_01_00_11]]


def test_three_bit_codes_round_trip_through_four_bit_storage():
    spec = QuantSpec(3, 32)
    q = quantize(_weights(), spec)
    assert torch.equal(unpack(pack(q.codes, spec.storage_bits), spec.storage_bits), q.codes)


def test_pack_rejects_overflowing_codes_and_3_bits():
    with pytest.raises(ValueError, match="exceeds"):
        pack(torch.tensor([[16, 0]], dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="bits"):
        pack(torch.zeros(1, 8, dtype=torch.uint8), 3)


@pytest.mark.parametrize(
    "spec,expected",
    [
        (QuantSpec(4, 64), 0.5 + 4 / 64),  # 4.5 bits per weight
        (QuantSpec(2, 32), 0.25 + 4 / 32),  # 3 bits
        (QuantSpec(8, 128), 1 + 4 / 128),
        (QuantSpec(3, 64), 0.5 + 4 / 64),  # stored in 4 bits
        (QuantSpec(4, 64, asymmetric=False), 0.5 + 2 / 64),  # no zero
    ],
)
def test_bytes_per_weight(spec: QuantSpec, expected: float):
    assert bytes_per_weight(spec) == pytest.approx(expected)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_tensor_nbytes_matches_stored_arrays(spec: QuantSpec):
    w = _weights((8, 256))
    q = quantize(w, spec)
    stored = pack(q.codes, spec.storage_bits).nbytes + q.scale.nbytes + (q.zero.nbytes if q.zero is not None else 0)
    assert tensor_nbytes(spec, tuple(w.shape)) == stored
    assert stored == pytest.approx(w.numel() * bytes_per_weight(spec))
