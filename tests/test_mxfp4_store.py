"""MXFP4 experts in the expert store (layout ``mxfp4``): kept as their blocks, the kind recorded per part and refused
by a reader that does not know it; a GGUF whose experts are MXFP4 (llama.cpp's type 39) converts without a second
rounding and its logits equal transformers' on the dequantized weights.

The architecture here is the bundled qwen2_moe model with its experts stored as MXFP4 (gpt-oss, the family that
publishes MXFP4, is added beside this work)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from _gguf_writer import write_gguf
from fate_edge.quant.mxfp4 import MXFP4, Mxfp4Linear, Mxfp4Weights, dequantize_mxfp4, quantize_mxfp4
from fate_edge.quant.spec import QuantSpec
from safetensors.torch import load_file, save_file

from fate_edge import Tokenizer
from fate_edge.errors import ModelFormatError
from fate_edge.format.convert import ConvertOptions
from fate_edge.format.gguf_convert import convert_gguf
from fate_edge.format.store import MATRICES, ExpertStore, Precision, decode_expert, encode_expert, plan_parts
from fate_edge.format.store_files import STORE_FILE
from fate_edge.model.experts import ExpertWeights, InMemoryExpertProvider, QuantizedExpert
from fate_edge.runtime.loader import load_model

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


def _expert(hidden: int, inter: int, seed: int) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    return ExpertWeights(
        *(torch.randn(s, generator=g) * 0.05 for s in ((inter, hidden), (inter, hidden), (hidden, inter)))
    )


def test_blob_keeps_the_blocks_and_computes_on_them():
    hidden, inter = 64, 96
    parts, nbytes = plan_parts(4, MXFP4, hidden, inter, "mxfp4")
    p = Precision(4, "experts-4.bin", nbytes, parts, MXFP4, "mxfp4", "uint8")
    assert {q.name: q.kind for q in parts} == {
        f"{m}.{t}": k for m in MATRICES for t, k in (("blocks", "e2m1"), ("scales", "e8m0"))
    }
    w = _expert(hidden, inter, 0)
    mx = {m: Mxfp4Weights(*quantize_mxfp4(getattr(w, m))) for m in MATRICES}
    blob = torch.frombuffer(bytearray(encode_expert(ExpertWeights(*mx.values()), p)), dtype=torch.uint8)
    e = decode_expert(blob, p, torch.float32)
    for m in MATRICES:
        lin = getattr(e, m)
        assert isinstance(lin, Mxfp4Linear) and lin.kernel == "native-mxfp4"
        assert torch.equal(lin.blocks, mx[m].blocks) and torch.equal(lin.scales, mx[m].scales)
        assert lin.blocks.data_ptr() >= blob.data_ptr()  # views of the blob, no copy
    x = torch.randn(3, hidden)
    dq = ExpertWeights(*(dequantize_mxfp4(*mx[m]) for m in MATRICES))
    want = dq(x)
    assert float((e(x) - want).abs().max()) <= 1e-5 * float(want.abs().max())
    resident = InMemoryExpertProvider({(0, 0): e}).get(0, 0)  # gate and up stacked: one call, the same rows
    assert isinstance(resident, QuantizedExpert) and isinstance(resident.gate_up, Mxfp4Linear)
    assert resident.gate_up.shape == (2 * inter, hidden) and resident.gate_up.blocks.data_ptr() != blob.data_ptr()
    for rows in (1, 2, 3):  # the decode paths and the row-buffered one
        assert torch.equal(resident(x[:rows]), e(x[:rows]))
    # float weights into an mxfp4 precision are encoded (llama.cpp's scheme): the same bytes as the blocks above
    assert bytes(encode_expert(w, p)) == bytes(encode_expert(ExpertWeights(*mx.values()), p))
    # a cold int2 copy of MXFP4 weights starts from their exact values
    spec2 = QuantSpec(2, 32)
    parts2, n2 = plan_parts(2, spec2, hidden, inter)
    p2 = Precision(2, "experts-2.bin", n2, parts2, spec2)
    assert bytes(encode_expert(ExpertWeights(*mx.values()), p2)) == bytes(encode_expert(dq, p2))


@pytest.fixture(scope="module")
def mxfp4_store(tmp_path_factory, bundled_dir):
    d = tmp_path_factory.mktemp("mxfp4")
    gguf = write_gguf(bundled_dir, d / "tiny-mxfp4.gguf", "MXFP4", "F32")
    return convert_gguf(gguf, d / "store", ConvertOptions.full(bits=None, keep_bf16=False), progress=False)


def test_gguf_mxfp4_experts_go_in_as_they_are(mxfp4_store, bundled_dir):
    store = ExpertStore(mxfp4_store)
    assert store.bits_available == [4]
    p = store.precisions[4]
    assert p.layout == "mxfp4" and p.spec == MXFP4
    index = json.loads((mxfp4_store / STORE_FILE).read_text())
    assert {part["kind"] for part in index["precisions"]["4"]["parts"]} == {"e2m1", "e8m0"}
    w = load_file(str(bundled_dir / "model.safetensors"))
    ref = store.ref(1, 5, 4)
    with open(ref.path, "rb") as f:
        f.seek(ref.offset)
        blob = torch.frombuffer(bytearray(f.read(ref.length)), dtype=torch.uint8)
    e = decode_expert(blob, p, torch.float32)
    for m in MATRICES:  # llama.cpp's encoder gives ours bit for bit (test_mxfp4_kernel): the file's own blocks
        blocks, scales = quantize_mxfp4(w[f"model.layers.1.mlp.experts.5.{m}_proj.weight"].float())
        assert torch.equal(getattr(e, m).blocks, blocks) and torch.equal(getattr(e, m).scales, scales)


@pytest.mark.slow
def test_gguf_mxfp4_logits_equal_transformers_on_the_dequantized_weights(mxfp4_store, bundled_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    hf_dir = tmp_path / "dequantized"
    shutil.copytree(bundled_dir, hf_dir)
    w = load_file(str(hf_dir / "model.safetensors"))
    for name in [n for n in w if ".mlp.experts." in n]:
        w[name] = dequantize_mxfp4(*quantize_mxfp4(w[name].float())).to(w[name].dtype)
    save_file(w, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    ids = torch.tensor([Tokenizer(mxfp4_store).encode(PROMPT)])
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(ids).logits[0]
    model = load_model(mxfp4_store, torch.float32, bits=4)
    try:
        got = model.forward(ids, model.new_cache())[0]
    finally:
        model.experts.close()
    assert float((got[-1] - want[-1]).abs().max()) <= 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize(
    ("field", "value", "message"), [("kind", "nvfp4", "kind is 'nvfp4'"), ("layout", "mxfp6", "layout is 'mxfp6'")]
)
def test_a_reader_refuses_a_kind_it_does_not_know(mxfp4_store, tmp_path, field, value, message):
    out = tmp_path / "store"
    shutil.copytree(mxfp4_store, out)
    index = json.loads((out / STORE_FILE).read_text())
    prec = index["precisions"]["4"]
    (prec["parts"][1] if field == "kind" else prec)[field] = value
    (out / STORE_FILE).write_text(json.dumps(index))
    with pytest.raises(ModelFormatError, match=f"{message}.*written by a newer fate-edge"):
        ExpertStore(out)


def test_a_nan_scale_in_a_gguf_is_named_with_its_tensor_and_expert(mxfp4_store, tmp_path):
    from gguf import GGUFReader

    src = next(mxfp4_store.parent.glob("*.gguf"))
    bad = tmp_path / "nan.gguf"
    shutil.copy(src, bad)
    name = "blk.1.ffn_down_exps.weight"
    t = next(t for t in GGUFReader(str(bad)).tensors if t.name == name)
    at = int(t.data_offset) + 3 * (int(t.n_bytes) // 16)  # expert 3's first block: its E8M0 byte comes first
    with open(bad, "r+b") as f:
        f.seek(at)
        f.write(bytes([255]))
    with pytest.raises(ModelFormatError, match=rf"tensor '{name}' \(expert 3\): an MXFP4 scale is 255"):
        convert_gguf(bad, tmp_path / "store", ConvertOptions.full(bits=None, keep_bf16=False), progress=False)
    assert not (tmp_path / "store").exists()
