"""quant.rtn.quantize (the one RTN encoder: library, convert and HQQ's start) and quant.pack give the bytes of
the textbook reference (tests/_rtn_reference.py) on real tensors, block by block in a reused scratch."""

import pytest
import torch
from _rtn_reference import reference_pack, reference_quantize
from fate_edge.quant import QuantSpec, linear, pack, rtn, unpack

from fate_edge.format.checkpoint import CheckpointReader

SPECS = [
    QuantSpec(4, 64),
    QuantSpec(4, 32),
    QuantSpec(4, 32, asymmetric=False),
    QuantSpec(3, 64),
    QuantSpec(2, 32),
    QuantSpec(8, 64),
    QuantSpec(8, 64, asymmetric=False),
]  # the bundled widths: 64k


def _assert_same(got, ref, spec: QuantSpec) -> None:
    for name, a, b in zip(("codes", "scale", "zero"), ref, got):
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name  # bits, signed zeros included
    packed = pack(got.codes, spec.storage_bits)
    assert torch.equal(packed, reference_pack(ref.codes, spec.storage_bits))
    assert torch.equal(unpack(packed, spec.storage_bits), got.codes)


@pytest.fixture(scope="module")
def bundled_expert(bundled_dir) -> list[torch.Tensor]:
    reader = CheckpointReader(bundled_dir)
    names = [n for n in reader.keys() if ".layers.1." in n and ".experts.3." in n]
    assert len(names) == 3
    return [reader.get(n, None) for n in sorted(names)]  # the checkpoint's own dtype, as convert reads it


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_bundled_expert_encodes_to_the_reference_bytes(bundled_expert, spec):
    work = torch.empty(16)  # too small: replaced by a block-sized scratch
    for w in bundled_expert:
        _assert_same(rtn.quantize(w, spec, work), reference_quantize(w, spec), spec)


@pytest.mark.parametrize("spec", [QuantSpec(4, 128), QuantSpec(2, 32), QuantSpec(4, 64, asymmetric=False)], ids=str)
def test_real_shape_matrix_encodes_to_the_reference_bytes(spec):
    """A Qwen1.5-MoE expert matrix (1408 x 2048, bf16): several blocks of rows, with the groups that are easy to
    get wrong (constant, zero, negative zero, a row a thousand times wider than the rest)."""
    gen = torch.Generator().manual_seed(spec.bits * 100 + spec.group_size)
    w = (torch.randn(1408, 2048, generator=gen) * 0.02).to(torch.bfloat16)
    w[3, :128] = 0.25
    w[5, 128:256] = 0.0
    w[7, 256:384] = -0.0
    w[9, 384:512] = w[9, 384:512].abs()
    w[9, 384:512:3], w[9, 385:512:3] = 0.0, -0.0  # the group minimum is a zero of either sign
    w[1000] *= 1e3
    assert 1408 * 2048 * 4 > 2 * rtn.BLOCK_BYTES  # more than one block
    _assert_same(rtn.quantize(w, spec), reference_quantize(w, spec), spec)


def test_block_size_and_leading_dims_do_not_change_the_codes(monkeypatch):
    torch.manual_seed(0)
    w = torch.randn(3, 37, 256, dtype=torch.float16)
    spec = QuantSpec(4, 64)
    ref = reference_quantize(w, spec)
    for block in (256 * 4, 5 * 256 * 4, 1 << 30):  # one row, 5 rows (111 = 22 x 5 + 1), everything
        monkeypatch.setattr(rtn, "BLOCK_BYTES", block)
        got = rtn.quantize(w, spec)
        assert got.codes.shape == w.shape and got.scale.shape == (3, 37, 4)
        _assert_same(got, ref, spec)


def test_scratch_is_reused_when_large_enough():
    w = torch.randn(64, 256)
    work = torch.full((64 * 256,), 7.0)
    rtn.quantize(w, QuantSpec(4, 64), work)
    assert not torch.equal(work, torch.full_like(work, 7.0))  # the block went through the caller's buffer


def test_non_finite_weights_are_reported_before_a_scale_overflow(monkeypatch):
    monkeypatch.setattr(rtn, "BLOCK_BYTES", 128 * 4)  # one row per block
    w = torch.randn(8, 128)
    w[2, 0], w[2, 1] = -1e5, 1e5  # finite, but past fp16: the group's range overflows its scale (block 2)
    spec = QuantSpec(2, 64)
    with pytest.raises(ValueError, match="overflows the fp16 scale"):
        rtn.quantize(w, spec)
    w[6, 9] = float("nan")  # a later block: still the error that names the cause
    with pytest.raises(ValueError, match="inf or nan"):
        rtn.quantize(w, spec)
    w[6, 9] = float("-inf")
    with pytest.raises(ValueError, match="inf or nan"):
        rtn.quantize(w, QuantSpec(4, 64, asymmetric=False))


@pytest.mark.parametrize("shape", [(1408, 2048), (2048, 1408), (96, 64), (160, 128), (48, 256)])
def test_cpu_int4_layout_is_torch_packers_bytes(shape):
    """convert writes the CPU kernel layout without torch's per-code packer: the same bytes, partial blocks too."""
    codes = torch.randint(0, 16, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(shape[0]))
    want = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)
    assert torch.equal(linear.pack_int4_cpu(codes), want)
    assert linear._INT4_BLOCK_ROWS[shape] in (64, 32)  # the vectorised layout was verified and is in use here
