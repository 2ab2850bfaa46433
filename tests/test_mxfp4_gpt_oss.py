"""gpt-oss as published, its experts in MXFP4 (``*_blocks`` / ``*_scales``, as transformers saves a quantized gpt-oss):
converted with the experts kept as their blocks (no second rounding) and computed on by the MXFP4 kernel, its logits
and greedy tokens those of transformers' own dequantized model; bad blocks or scales are named at convert. The GGUF
llama.cpp writes of it (MXFP4 expert tensors, type 39) converts to the same blocks and logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from _parity import NEW_TOKENS, max_diff, our_greedy  # noqa: E402
from _tiny_moe import VOCAB, build_tokenizer  # noqa: E402
from fate_edge.quant.mxfp4 import MXFP4, Mxfp4Linear, dequantize_mxfp4, quantize_mxfp4  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from test_parity_gpt_oss import build  # noqa: E402

from fate_edge.errors import ModelFormatError  # noqa: E402
from fate_edge.format.convert import ConvertOptions, convert  # noqa: E402
from fate_edge.format.store import ExpertStore, decode_expert  # noqa: E402
from fate_edge.runtime.loader import load_model  # noqa: E402

PROMPT = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1234))
MATS = ("gate_up_proj", "down_proj")
# what the published checkpoints' quantization_config says (openai/gpt-oss-20b)
QUANT = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


def to_mxfp4(path: Path) -> None:
    """Rewrite the float gpt-oss at ``path`` as transformers saves a quantized one: each expert matrix as
    ``<name>_blocks`` [E, out, in/32, 16] and ``<name>_scales`` [E, out, in/32] (rows in the [out, in] order; the
    float layout is [E, in, out]), biases and everything else as they were, and the config's quantization_config."""
    w = load_file(str(path / "model.safetensors"))
    for name in [n for n in w if n.endswith(tuple(f"experts.{m}" for m in MATS))]:
        blocks, scales = quantize_mxfp4(w.pop(name).float().transpose(1, 2))
        w[f"{name}_blocks"] = blocks.reshape(*scales.shape, 16).contiguous()
        w[f"{name}_scales"] = scales.contiguous()
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {"quantization_config": QUANT}))


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    _, path = build(root / "hf")
    to_mxfp4(path)
    config = transformers.Mxfp4Config(dequantize=True)  # transformers' own dequantizer, as on a host without Triton
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=config)
    hf.eval()
    with torch.no_grad():
        logits = hf(PROMPT).logits
        out = hf.generate(
            PROMPT, attention_mask=torch.ones_like(PROMPT), do_sample=False, max_new_tokens=NEW_TOKENS,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    store = convert(path, root / "store", ConvertOptions.full(bits=4, keep_bf16=False), progress=False)
    return dict(path=path, store=store, logits=logits, tokens=out[0, PROMPT.shape[1] :].tolist())


def test_experts_are_stored_as_the_checkpoints_blocks(published):
    store = ExpertStore(published["store"])
    p = store.precisions[4]
    assert p.layout == "mxfp4" and p.spec == MXFP4 and store.bits_available == [4]
    w = load_file(str(published["path"] / "model.safetensors"))
    for layer, e in ((0, 3), (2, 7)):
        ref = store.ref(layer, e, 4)
        with open(ref.path, "rb") as f:
            f.seek(ref.offset)
            expert = decode_expert(memoryview(bytearray(f.read(ref.length))), p, torch.float32)
        pre = f"model.layers.{layer}.mlp.experts"
        gu_b, gu_s = w[f"{pre}.gate_up_proj_blocks"][e].flatten(1), w[f"{pre}.gate_up_proj_scales"][e]
        want = {  # gate and up rows alternate in the checkpoint
            "gate": (gu_b[::2], gu_s[::2]),
            "up": (gu_b[1::2], gu_s[1::2]),
            "down": (w[f"{pre}.down_proj_blocks"][e].flatten(1), w[f"{pre}.down_proj_scales"][e]),
        }
        for m, (blocks, scales) in want.items():
            lin = getattr(expert, m)
            assert isinstance(lin, Mxfp4Linear) and lin.kernel == "native-mxfp4"
            assert torch.equal(lin.blocks, blocks) and torch.equal(lin.scales, scales)
        assert expert.bias is not None and expert.glu.limit == 1.0


@pytest.mark.slow
def test_store_logits_and_greedy_equal_transformers_dequantized_model(published):
    model = load_model(published["store"], torch.float32, bits=4)
    try:
        assert max_diff(model(PROMPT, model.new_cache()), published["logits"]) <= 1e-4
        tokens, _ = our_greedy(model, PROMPT)
    finally:
        model.experts.close()
    assert tokens == published["tokens"]


def test_the_checkpoint_loads_directly_with_its_experts_dequantized_exactly(published):
    model = load_model(published["path"], torch.float32)
    assert max_diff(model(PROMPT, model.new_cache()), published["logits"]) <= 1e-4


def _damaged(src: Path, dst: Path, name: str, change) -> Path:
    shutil.copytree(src, dst)
    w = load_file(str(dst / "model.safetensors"))
    w[name] = change(w[name])
    save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_scales_of_the_wrong_shape_are_named(published, tmp_path):
    name = "model.layers.1.mlp.experts.down_proj_scales"
    path = _damaged(published["path"], tmp_path / "hf", name, lambda s: s[:, :, :-1].contiguous())
    with pytest.raises(ModelFormatError, match=rf"tensor '{name}' has shape \[8, 64, 0\], expected \[8, 64, 1\]"):
        convert(path, tmp_path / "store", ConvertOptions.full(bits=4, keep_bf16=False), progress=False)
    assert not (tmp_path / "store").exists()


def test_a_nan_scale_is_named_with_its_expert(published, tmp_path):
    name = "model.layers.2.mlp.experts.gate_up_proj_scales"

    def nan(s: torch.Tensor) -> torch.Tensor:
        s = s.clone()
        s[5, 3, 0] = 255
        return s

    path = _damaged(published["path"], tmp_path / "hf", name, nan)
    blocks = name.replace("_scales", "_blocks")
    with pytest.raises(ModelFormatError, match=rf"tensor '{blocks}' \(expert 5\): an MXFP4 scale is 255"):
        convert(path, tmp_path / "store", ConvertOptions.full(bits=4, keep_bf16=False), progress=False)
    assert not (tmp_path / "store").exists()


@pytest.mark.slow
def test_a_gguf_with_mxfp4_experts_keeps_them_and_matches_transformers(tmp_path):
    """llama.cpp's GGUF of a gpt-oss whose experts are on the MXFP4 grid (so its MXFP4 quantizer, ours bit for bit,
    gives back the same blocks): the store keeps the blocks and its logits are transformers' on the checkpoint
    (within 1e-4: GGUF holds rms_norm_eps in float32), at llama.cpp's clamp constants."""
    from _gguf_gpt_oss import write_gpt_oss_gguf

    from fate_edge.format.gguf_convert import convert_gguf

    hf, path = build(tmp_path / "hf", vocab_size=VOCAB, swiglu_limit=7.0)
    build_tokenizer(path)
    w = load_file(str(path / "model.safetensors"))
    for name in [n for n in w if n.endswith(tuple(f"experts.{m}" for m in MATS))]:  # onto the grid, [E, out, in]
        w[name] = dequantize_mxfp4(*quantize_mxfp4(w[name].float().transpose(1, 2))).transpose(1, 2).contiguous()
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(PROMPT).logits
    gguf = write_gpt_oss_gguf(path, tmp_path / "m.gguf", "MXFP4")
    store = convert_gguf(gguf, tmp_path / "store", ConvertOptions.full(bits=None, keep_bf16=False), progress=False)
    p = ExpertStore(store).precisions[4]
    assert p.layout == "mxfp4" and p.glu.limit == 7.0
    model = load_model(store, torch.float32, bits=4)
    try:
        assert max_diff(model(PROMPT, model.new_cache()), want) <= 1e-4
    finally:
        model.experts.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_experts_go_through_grouped_calls_with_the_bits_of_one_call_each(published, monkeypatch, dtype):
    """A layer's MXFP4 experts, held in memory (a resident run: the provider hands a step's experts out together),
    compute in grouped kernel calls (``model.grouped_experts``, as int4's do), in fp32 and in bf16 (the AVX-512 BF16
    path where the CPU has it), and the logits are those of one call per expert."""
    from fate_edge.model import grouped_experts
    from fate_edge_lab.bench.sidebyside import resident_int4

    calls: list[int] = []
    real = grouped_experts.compute_group

    def counting(items):
        calls.append(len(items))
        return real(items)

    def logits() -> torch.Tensor:
        model = load_model(published["store"], dtype, experts=resident_int4(published["store"]))
        return model(PROMPT, model.new_cache())

    monkeypatch.setattr(grouped_experts, "compute_group", counting)
    grouped = logits()
    assert calls and max(calls) >= 2
    monkeypatch.setattr(grouped_experts, "groupable", lambda items: False)
    apart = logits()
    assert torch.equal(grouped, apart)
    if dtype == torch.float32:
        assert max_diff(grouped, published["logits"]) <= 1e-4
