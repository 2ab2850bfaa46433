"""q4_0 blocks repacked straight into the portable layout (``gguf_blocks.to_packed``) give the bytes the general path
gives (codes unpacked one a byte, then ``quant.pack``): in the packed codes, the scales and zeros, and whole expert
blobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fate_edge.quant import QuantSpec, pack
from fate_edge.quant.native import native_status
from gguf import GGMLQuantizationType, quants

from fate_edge.format import gguf_blocks
from fate_edge.format.gguf_blocks import to_packed, to_quantized
from fate_edge.format.store import MATRICES, Precision, encode_expert, plan_parts
from fate_edge.model.experts import ExpertWeights

SPEC = QuantSpec(4, 32)


def _q4_0(rows: int, k: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, k)) * rng.choice([1e-4, 0.02, 3.0], (rows, 1))).astype(np.float32)
    w[0] = 0
    return torch.from_numpy(quants.quantize(w, GGMLQuantizationType.Q4_0).copy())


@pytest.fixture(params=["native", "torch"])
def repack(request, monkeypatch):
    """Both repackers: the native library's (where it builds) and the torch one it falls back to."""
    if request.param == "torch":
        monkeypatch.setattr(gguf_blocks, "q4_0_codes", lambda blocks: None)
    elif not native_status()[0]:
        pytest.skip(f"the native library is not available here: {native_status()[1]}")
    return request.param


@pytest.mark.parametrize("rows, k", [(4, 32), (7, 96), (64, 256)])
def test_packed_codes_scales_and_zeros_are_the_general_paths(rows, k, repack):
    raw = _q4_0(rows, k, seed=rows)
    packed = to_packed("Q4_0", raw, SPEC)
    q = to_quantized("Q4_0", raw, SPEC)
    assert packed is not None
    assert torch.equal(packed.packed, pack(q.codes, 4))
    assert torch.equal(packed.scale.view(torch.int16), q.scale.view(torch.int16))  # bits, -0.0 included
    assert q.zero is not None and packed.zero is not None
    assert torch.equal(packed.zero.view(torch.int16), q.zero.view(torch.int16))


def test_an_expert_blob_from_packed_blocks_is_byte_identical(repack):
    hidden, inter = 64, 96
    parts, nbytes = plan_parts(4, SPEC, hidden, inter, "portable")
    p = Precision(bits=4, spec=SPEC, file="experts.int4", parts=parts, blob_bytes=nbytes, layout="portable")
    raw = {"gate": _q4_0(inter, hidden, 1), "up": _q4_0(inter, hidden, 2), "down": _q4_0(hidden, inter, 3)}
    fast = {m: to_packed("Q4_0", raw[m], SPEC) for m in MATRICES}
    slow = {m: to_quantized("Q4_0", raw[m], SPEC) for m in MATRICES}
    a = encode_expert(ExpertWeights(*(fast[m] for m in MATRICES)), p)
    b = encode_expert(ExpertWeights(*(slow[m] for m in MATRICES)), p)
    assert bytes(a) == bytes(b)


def test_no_shortcut_where_the_codes_are_not_stored_four_bits_a_code():
    raw = _q4_0(4, 64, 0)
    assert to_packed("Q4_0", raw, QuantSpec(8, 32)) is None  # an int8 store keeps a byte per code
    assert to_packed("Q8_0", torch.zeros(4, 68, dtype=torch.uint8), QuantSpec(8, 32)) is None
