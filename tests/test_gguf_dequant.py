"""The torch dequantizers of ``format/gguf_dequant.py`` give the very floats of the ``gguf`` package's numpy ones
(compared bit for bit, so -0.0 against 0.0 counts): on blocks the package quantizes itself where it can (q4_0, mxfp4,
q4_1, q5_0, q5_1, q8_0), and on random raw blocks with finite fp16 fields for the K types it cannot write."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, quants

from fate_edge.format import gguf_dequant
from fate_edge.format.gguf_dequant import TORCH_TYPES, dequantize_blocks
from fate_edge.format.gguf_reader import GGUFFile

QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4")
FP16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # byte offsets of each block's fp16 numbers


def _same_bits(got: torch.Tensor, want: np.ndarray) -> bool:
    return got.shape == want.shape and np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))


def _quantized(type_name: str, rows: int, k: int, seed: int) -> np.ndarray:
    """Raw blocks the gguf package quantizes itself, from weights of mixed magnitudes (some rows all-zero)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, k)) * rng.choice([1e-4, 0.02, 3.0], (rows, 1))).astype(np.float32)
    w[0] = 0
    return quants.quantize(w, GGMLQuantizationType[type_name])


def _random_blocks(type_name: str, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Random bytes are valid blocks once the fp16 fields are finite: set them, from subnormal to large."""
    rng = np.random.default_rng(seed)
    size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][1]
    raw = rng.integers(0, 256, (rows, blocks_per_row, size), dtype=np.uint8)
    for at in FP16_FIELDS[type_name]:
        mag = rng.choice([1e-7, 1e-3, 0.5, 300.0], (rows, blocks_per_row))  # 1e-7 is an fp16 subnormal
        value = (rng.standard_normal((rows, blocks_per_row)) * mag).astype(np.float16)
        raw[..., at : at + 2] = value.view(np.uint8).reshape(rows, blocks_per_row, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("type_name", QUANTIZABLE)
def test_blocks_the_package_quantizes_dequantize_to_its_floats(type_name):
    raw = _quantized(type_name, 24, 256, seed=1)
    want = quants.dequantize(raw, GGMLQuantizationType[type_name])
    assert _same_bits(dequantize_blocks(type_name, torch.from_numpy(raw)), want)


@pytest.mark.parametrize("type_name", sorted(FP16_FIELDS))
def test_random_k_blocks_dequantize_to_the_packages_floats(type_name):
    raw = _random_blocks(type_name, 48, 3, seed=2)
    want = quants.dequantize(raw, GGMLQuantizationType[type_name])
    assert _same_bits(dequantize_blocks(type_name, torch.from_numpy(raw)), want)


@pytest.mark.parametrize("type_name", sorted(TORCH_TYPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantizing_into_a_narrower_dtype_rounds_as_to_does(type_name, dtype, monkeypatch):
    """Chunk by chunk into ``dtype``: the very bits of the float32 result's ``.to(dtype)`` (signed zeros included)."""
    monkeypatch.setattr(gguf_dequant, "CHUNK_WEIGHTS", 1000)  # several chunks, the last one short
    blocks = 5 if type_name.endswith("_K") else 40
    if type_name in FP16_FIELDS:
        raw = _random_blocks(type_name, 7, blocks, seed=3)
    else:
        raw = _quantized(type_name, 7, 32 * blocks, seed=3)
    want = dequantize_blocks(type_name, torch.from_numpy(raw)).to(dtype)
    got = dequantize_blocks(type_name, torch.from_numpy(raw), dtype)
    assert got.dtype == dtype and torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("type_name", ["Q6_K", "Q5_0"])
def test_chunk_boundaries_do_not_show(type_name, monkeypatch):
    """Chunks smaller than a row and a last chunk that is cut short give the same floats as one pass."""
    raw = _random_blocks(type_name, 7, 5, seed=3) if type_name == "Q6_K" else _quantized(type_name, 7, 160, seed=3)
    whole = dequantize_blocks(type_name, torch.from_numpy(raw))
    monkeypatch.setattr(gguf_dequant, "CHUNK_WEIGHTS", 3 * 256)  # 3 blocks of 256 (or 24 of 32) per chunk
    chunked = dequantize_blocks(type_name, torch.from_numpy(raw))
    assert torch.equal(chunked.view(torch.int32), whole.view(torch.int32))
    assert _same_bits(chunked, quants.dequantize(raw, GGMLQuantizationType[type_name]))


def test_the_reader_dequantizes_every_torch_type_as_the_package_does(tmp_path):
    """GGUFFile.dequantize (whole tensors and row ranges) on a file holding one tensor of each type."""
    path = tmp_path / "types.gguf"
    w = GGUFWriter(str(path), "llama")
    raws = {}
    for i, type_name in enumerate(sorted(TORCH_TYPES)):
        qtype = GGMLQuantizationType[type_name]
        if type_name in QUANTIZABLE:
            raw = _quantized(type_name, 6, 512, seed=10 + i)
        else:
            raw = _random_blocks(type_name, 6, 2, seed=10 + i)
        raws[type_name] = raw
        w.add_tensor(f"t.{type_name}", raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(path)
    try:
        for type_name, raw in raws.items():
            qtype = GGMLQuantizationType[type_name]
            name = f"t.{type_name}"
            assert f.info(name).qtype == qtype
            want = quants.dequantize(raw, qtype)
            assert want.shape == (6, 512)
            assert _same_bits(f.dequantize(name), want), type_name
            assert _same_bits(f.dequantize(name, 2, 3), want[2:5]), type_name
    finally:
        f.close()
