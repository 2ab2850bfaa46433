"""``fate-edge synth --like gpt-oss-20b --mxfp4``: the experts written as OpenAI publishes them (``*_blocks`` /
``*_scales`` uint8 and the quantization_config), the float layout's own weights encoded. On a tiny-width variant of the
preset, transformers loads it (dequantizing) and fate-edge's store, its MXFP4 experts kept, gives transformers'
logits and greedy tokens."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from fate_edge.quant.mxfp4 import quantize_mxfp4
from safetensors import safe_open

from fate_edge.format.checkpoint import INDEX_FILE
from fate_edge_lab.synthetic import PRESETS, SyntheticOptions, make_synthetic_model, plan
from fate_edge_lab.synthetic.cli import main as synth_main
from fate_edge_lab.synthetic.mxfp4_experts import QUANTIZATION_CONFIG, mxfp4_specs

transformers = pytest.importorskip("transformers")

TINY = "gpt-oss-tiny"  # gpt-oss-20b's config, widths cut to MXFP4 blocks: 2 layers (sliding, full), 4 experts
WIDTHS = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
WIDTHS |= dict(num_hidden_layers=2, num_local_experts=4, experts_per_token=2, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = PRESETS["gpt-oss-20b"]
    config = base.config | WIDTHS | {"layer_types": ["sliding_attention", "full_attention"]}
    PRESETS[TINY] = dataclasses.replace(base, name=TINY, config=config)
    try:
        root = tmp_path_factory.mktemp("synth_mxfp4")
        kw = dict(seed=3, max_shard_bytes=20_000_000, bpe_vocab=300, tokenizer_chars=20_000)
        for mxfp4 in (True, False):
            make_synthetic_model(root / str(mxfp4), SyntheticOptions(TINY, mxfp4=mxfp4, **kw))  # type: ignore[arg-type]
        yield root / "True", root / "False"
    finally:
        del PRESETS[TINY]


def _tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in set(json.loads((path / INDEX_FILE).read_text())["weight_map"].values()):
        with safe_open(str(path / shard), framework="pt") as f:
            out |= {k: f.get_tensor(k) for k in f.keys()}
    return out


@pytest.mark.slow
def test_experts_are_the_float_layouts_weights_in_the_published_mxfp4_layout(tiny):
    mx, fl = _tensors(tiny[0]), _tensors(tiny[1])
    assert json.loads((tiny[0] / "config.json").read_text())["quantization_config"] == QUANTIZATION_CONFIG
    assert "quantization_config" not in json.loads((tiny[1] / "config.json").read_text())
    for layer in range(2):
        for m, (n, k) in (("gate_up_proj", (192, 64)), ("down_proj", (64, 96))):
            name = f"model.layers.{layer}.mlp.experts.{m}"
            blocks, scales = mx.pop(f"{name}_blocks"), mx.pop(f"{name}_scales")
            assert blocks.dtype == scales.dtype == torch.uint8
            assert blocks.shape == (4, n, k // 32, 16) and scales.shape == (4, n, k // 32)  # openai/gpt-oss-20b's
            want_b, want_s = quantize_mxfp4(fl.pop(name).float().transpose(1, 2))  # [E, in, out] → [E, out, in]
            assert torch.equal(blocks.reshape(4, n, -1), want_b) and torch.equal(scales, want_s)
    assert mx.keys() == fl.keys() and all(torch.equal(mx[k], fl[k]) for k in mx)  # everything else as it was


@pytest.mark.slow
def test_transformers_loads_it_and_our_store_matches_its_logits(tiny, tmp_path):
    from fate_edge.format.convert import ConvertOptions, convert
    from fate_edge.format.store import ExpertStore
    from fate_edge.runtime.loader import load_model

    path = tiny[0]
    prompt = torch.randint(0, 300, (1, 10), generator=torch.Generator().manual_seed(0))
    config = transformers.Mxfp4Config(dequantize=True)  # transformers' own dequantizer (no Triton on a CPU)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=config)
    with torch.no_grad():
        ref = hf.eval()(prompt).logits
        hf_tokens = hf.generate(
            prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=6, eos_token_id=None,
            pad_token_id=0,
        )[0, prompt.shape[1] :].tolist()  # fmt: skip
    store = convert(path, tmp_path / "store", ConvertOptions.full(bits=4, keep_bf16=False), progress=False)
    assert ExpertStore(store).precisions[4].layout == "mxfp4"  # kept as written, no second rounding
    ours = load_model(store, dtype=torch.float32)
    got = ours(prompt, ours.new_cache())
    assert (got - ref).abs().max().item() <= 1e-4
    cache, ids, tokens = ours.new_cache(), prompt, []
    for _ in range(6):
        nxt = int(ours(ids, cache)[0, -1].argmax())
        tokens.append(nxt)
        ids = torch.tensor([[nxt]])
    assert tokens == hf_tokens


def test_mxfp4_is_refused_where_it_does_not_apply(capsys):
    with pytest.raises(ValueError, match=r"^--mxfp4: qwen1\.5-moe-a2\.7b publishes no MXFP4 experts"):
        plan(SyntheticOptions("qwen1.5-moe-a2.7b", mxfp4=True))
    _, specs, _ = plan(SyntheticOptions("gpt-oss-20b", scale=16, mxfp4=True))
    with pytest.raises(ValueError, match=r"^--mxfp4: model\.layers\.0\.mlp\.experts\.gate_up_proj has 180 inputs"):
        mxfp4_specs(specs)
    with pytest.raises(SystemExit, match=r"^fate-edge synth: --mxfp4: .* not a multiple of MXFP4's 32"):
        synth_main(["--like", "gpt-oss-20b", "--scale", "16", "--mxfp4", "/nonexistent/never-written"])
    full = mxfp4_specs(plan(SyntheticOptions("gpt-oss-20b", layers=2, mxfp4=True))[1])
    shapes = {e.name: e.shape for e in full if e.name.startswith("model.layers.1.mlp.experts.")}
    assert shapes["model.layers.1.mlp.experts.gate_up_proj_blocks"] == (32, 5760, 90, 16)  # openai/gpt-oss-20b's
    assert shapes["model.layers.1.mlp.experts.down_proj_scales"] == (32, 2880, 90)
