"""q4_K experts go into the store exactly: fp32 scale and zero parts (``d sc`` and ``-dmin m`` round in fp16), so
every dequantized expert weight is the gguf package's float, bit for bit, and the native kernel computes on them.
gguf-py cannot write q4_K: the blocks are hand-made (random, or ``_gguf_writer.q4_k_blocks`` from real weights).
Also: stores written before ``scale_dtype`` was read still load, and an unknown dtype is named."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _gguf_writer import q4_k_blocks, write_gguf
from _tiny_moe import build_tiny_moe, build_wide_moe
from fate_edge.quant import Quantized, QuantSpec, dequantize
from gguf import GGMLQuantizationType, quants

from fate_edge.errors import ModelFormatError
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.format.gguf_blocks import to_quantized
from fate_edge.format.gguf_convert import convert_gguf
from fate_edge.format.gguf_reader import GGUFFile
from fate_edge.format.gguf_tensors import expert_tensor
from fate_edge.format.store import MATRICES, STORE_FILE, ExpertStore, decode_expert
from fate_edge.runtime.loader import load_model

SPEC = QuantSpec(4, 32)


def _same_bits(got: torch.Tensor, want: np.ndarray) -> bool:
    return got.shape == want.shape and np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))


def _random_q4_k(rows: int, blocks: int, seed: int) -> np.ndarray:
    """Random bytes are valid q4_K blocks once d and dmin are finite: set them, from fp16 subnormal to large."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, blocks, 144), dtype=np.uint8)
    for at in (0, 2):
        mag = rng.choice([1e-7, 1e-3, 0.5, 300.0], (rows, blocks))
        value = (rng.standard_normal((rows, blocks)) * mag).astype(np.float16)
        raw[..., at : at + 2] = value.view(np.uint8).reshape(rows, blocks, 2)
    return raw.reshape(rows, -1)


def test_q4_k_blocks_dequantize_to_the_packages_floats():
    """code * scale + zero with fp32 d sc and -(dmin m) is ggml's (d sc) q - dmin m: both products exact, one
    rounding of the same sum, so the same float, signed zeros included. Rounded to fp16 the scales would differ."""
    raw = _random_q4_k(64, 3, seed=0)
    raw[0, 0:4] = 0  # d = dmin = 0: a block of zeros
    want = quants.dequantize(raw, GGMLQuantizationType.Q4_K)
    q = to_quantized("Q4_K", torch.from_numpy(raw), SPEC)
    assert q.scale.dtype == q.zero.dtype == torch.float32
    assert _same_bits(dequantize(q, SPEC), want)
    fp16 = Quantized(q.codes, q.scale.half(), q.zero.half())
    assert not _same_bits(dequantize(fp16, SPEC), want)  # what the store held before: a test that can fail


def _q4_k_model(out):
    """A 2-layer Qwen2-MoE checkpoint whose expert rows are whole q4_K super-blocks (hidden and expert width 256)."""
    build_wide_moe(out, 256)
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return out


@pytest.fixture(scope="module")
def q4_k_store(tmp_path_factory):
    d = tmp_path_factory.mktemp("q4k")
    path = write_gguf(_q4_k_model(d / "model"), d / "tiny-q4_k.gguf", "Q4_K", "F32")
    store = convert_gguf(path, d / "store", ConvertOptions.full(bits=None, keep_bf16=False), progress=False)
    return path, store


def _dequant_kernel_only(monkeypatch) -> None:
    """Stored codes decode for dequantize-then-matmul (fp32 weights as stored), not a kernel that rounds scales."""
    monkeypatch.setattr("fate_edge.quant.linear.native_is_default", lambda: False)
    monkeypatch.setattr("fate_edge.quant.linear.int4_supported", lambda *a: False)


def test_a_q4_k_gguf_converts_to_fp32_scales_that_dequantize_to_the_packages_floats(q4_k_store, monkeypatch):
    path, store_dir = q4_k_store
    store = ExpertStore(store_dir)
    prec = store.precisions[4]
    assert store.bits_available == [4] and prec.layout == "portable" and prec.scale_dtype == "float32"
    index = json.loads((store_dir / STORE_FILE).read_text())
    assert index["precisions"]["4"]["scale_dtype"] == "float32"
    scales = [p for p in prec.parts if p.name.endswith((".scale", ".zero"))]
    assert len(scales) == 6 and all(p.dtype == "float32" and p.nbytes == 4 * p.shape[0] * p.shape[1] for p in scales)
    _dequant_kernel_only(monkeypatch)
    g = GGUFFile(path)
    for layer in (0, 1):
        for expert in range(4):
            ref = store.ref(layer, expert, 4)
            with open(ref.path, "rb") as f:
                f.seek(ref.offset)
                blob = torch.frombuffer(bytearray(f.read(ref.length)), dtype=torch.uint8)
            decoded = decode_expert(blob, prec, torch.float32)
            for m in MATRICES:
                lin = getattr(decoded, m)
                assert lin.kernel == "dequant" and lin.q.scale.dtype == torch.float32
                info = g.info(expert_tensor(layer, m))
                raw = g.read_bytes(info.name, expert, 1).reshape(info.shape[1], -1)
                want = quants.dequantize(raw, GGMLQuantizationType.Q4_K)
                assert _same_bits(dequantize(lin.q, SPEC), want), (layer, expert, m)


PROMPT_IDS = [3, 17, 99, 5, 250, 8, 61, 7, 42, 11]


def _logits(store) -> tuple[torch.Tensor, str]:
    model = load_model(store, torch.float32, bits=4)
    out = model.forward(torch.tensor([PROMPT_IDS]), model.new_cache())
    kernel = model.experts.get(1, 2).kernel
    model.experts.close()
    return out[0], kernel


def test_q4_k_store_logits_on_the_native_kernel(q4_k_store, monkeypatch):
    """The engine on the native kernel (taken here whatever the CPU's default) against dequantize-then-matmul on
    the same store, whose weights are the gguf package's floats (test above): the native kernel quantizes
    activations to int8 per 32 values, so they agree within that error, not to fp32 accumulation (the kernel's
    reading of fp32 scales is checked exactly in test_native_int4.py)."""
    _, store = q4_k_store
    with monkeypatch.context() as m:
        _dequant_kernel_only(m)
        ref, kernel = _logits(store)
        assert kernel == "dequant"
    monkeypatch.setattr("fate_edge.quant.linear.native_is_default", lambda: True)
    got, kernel = _logits(store)
    assert kernel == "native-int4"
    assert torch.isfinite(ref).all() and ref.std() > 0
    assert (got - ref).pow(2).mean().sqrt() < 0.02 * ref.pow(2).mean().sqrt()


@pytest.mark.parametrize("layout", ["portable", "cpu-int4"])
def test_a_store_without_scale_dtype_loads_as_before(tmp_path, layout):
    """Stores written before the index's scale_dtype was read: the layout's default (fp16 portable, bf16 cpu-int4),
    and the same logits as with the field."""
    model = build_tiny_moe(tmp_path / "m", expert_dim=32)
    store = convert(model, tmp_path / "s", ConvertOptions.full(bits=4, keep_bf16=False, layout=layout), progress=False)
    want = {"portable": "float16", "cpu-int4": "bfloat16"}[layout]
    assert ExpertStore(store).precisions[4].scale_dtype == want
    before, _ = _logits(store)
    index_path = store / STORE_FILE
    index = json.loads(index_path.read_text())
    assert index["precisions"]["4"].pop("scale_dtype") == want
    index_path.write_text(json.dumps(index))
    prec = ExpertStore(store).precisions[4]
    assert prec.layout == layout and prec.scale_dtype == want
    after, _ = _logits(store)
    assert torch.equal(before, after)


def test_unknown_dtypes_are_named(tmp_path):
    model = build_tiny_moe(tmp_path / "m", expert_dim=32)
    store = convert(
        model, tmp_path / "s", ConvertOptions.full(bits=4, keep_bf16=False, layout="portable"), progress=False
    )
    index_path = store / STORE_FILE
    good = index_path.read_text()
    index = json.loads(good)
    index["precisions"]["4"]["scale_dtype"] = "float64"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelFormatError, match=r"precisions\.4\.scale_dtype is 'float64', not one of float16, float32"):
        ExpertStore(store)
    index = json.loads(good)
    index["precisions"]["4"]["parts"][1]["dtype"] = "float8_e4m3"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelFormatError, match=r"parts\[1\]\.dtype is 'float8_e4m3', not one of"):
        ExpertStore(store)


def test_hand_made_q4_k_blocks_are_close_to_their_weights():
    """The test writer's q4_K rounding is a sane quantizer (errors within a group's step), so the logits above
    compare a working model, not noise."""
    x = (np.random.default_rng(1).standard_normal((8, 512)) * 0.05).astype(np.float32)
    back = quants.dequantize(q4_k_blocks(x), GGMLQuantizationType.Q4_K)
    step = (x.reshape(8, -1, 32).max(-1) - np.minimum(x.reshape(8, -1, 32).min(-1), 0)) / 15
    assert (np.abs(back - x).reshape(8, -1, 32).max(-1) <= step).all()
