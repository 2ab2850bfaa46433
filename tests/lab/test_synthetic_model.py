"""Synthetic checkpoints shaped like published MoE models (fate_edge_lab.synthetic, fate-edge synth).

Scaled-down copies (widths / 16, 4 layers, the published vocabularies and expert counts) are written by the
generator, loaded by fate-edge and by transformers, and compared; the full-size shapes are checked from the
plan without writing them.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fate_edge import Tokenizer, load_model
from fate_edge.format.checkpoint import INDEX_FILE
from fate_edge_lab.synthetic import PRESETS, SyntheticOptions, SyntheticSpecError, make_synthetic_model, plan
from fate_edge_lab.synthetic.measure import measure_router_structure
from fate_edge_lab.synthetic.weights import BLOCK_VALUES
from fate_edge_lab.synthetic.writer import write_checkpoint

transformers = pytest.importorskip("transformers")

SCALE, LAYERS = 16, 4
SHARD_BYTES = 24_000_000  # small shards, so every scaled model has several
FP32_ATOL = 1e-4  # DESIGN.md §3

# Published numbers, typed in from each model's config.json / model card (independently of presets.py):
# hidden, layers, heads, kv heads, experts, top-k, expert width, vocab, total params.
PUBLISHED = {
    "qwen1.5-moe-a2.7b": dict(
        hidden_size=2048,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        num_experts=60,
        num_experts_per_tok=4,
        moe_intermediate_size=1408,
        vocab_size=151936,
        shared_expert_intermediate_size=5632,
        norm_topk_prob=False,
        params=14.3e9,
    ),
    "olmoe-1b-7b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        num_experts=64,
        num_experts_per_tok=8,
        intermediate_size=1024,
        vocab_size=50304,
        norm_topk_prob=False,
        params=6.9e9,
    ),
    "deepseek-v2-lite": dict(
        hidden_size=2048,
        num_hidden_layers=27,
        num_attention_heads=16,
        n_routed_experts=64,
        num_experts_per_tok=6,
        moe_intermediate_size=1408,
        n_shared_experts=2,
        first_k_dense_replace=1,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        intermediate_size=10944,
        vocab_size=102400,
        params=15.7e9,
    ),
    "qwen3-30b-a3b": dict(
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        vocab_size=151936,
        norm_topk_prob=True,
        rope_theta=1e6,
        params=30.5e9,
    ),
    "mixtral-8x7b": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        intermediate_size=14336,
        vocab_size=32000,
        rope_theta=1e6,
        params=46.7e9,
    ),
    "glm-4.5-air": dict(
        hidden_size=4096,
        num_hidden_layers=46,
        num_attention_heads=96,
        num_key_value_heads=8,
        head_dim=128,
        n_routed_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=1408,
        n_shared_experts=1,
        first_k_dense_replace=1,
        partial_rotary_factor=0.5,
        num_nextn_predict_layers=1,
        vocab_size=151552,
        params=106e9,  # the model card's count leaves out the MTP layer
    ),
    "ernie-4.5-21b-a3b": dict(
        hidden_size=2560,
        num_hidden_layers=28,
        num_attention_heads=20,
        num_key_value_heads=4,
        moe_num_experts=64,
        moe_k=6,
        moe_intermediate_size=1536,
        moe_num_shared_experts=2,
        moe_layer_start_index=1,
        vocab_size=103424,
        tie_word_embeddings=True,
        params=21.8e9,  # the hub's count of the safetensors (the card rounds to 21B)
    ),
    "minimax-m2": dict(
        hidden_size=3072,
        num_hidden_layers=62,
        num_attention_heads=48,
        num_key_value_heads=8,
        head_dim=128,
        rotary_dim=64,
        num_local_experts=256,
        num_experts_per_tok=8,
        intermediate_size=1536,
        vocab_size=200064,
        params=230e9,
    ),
    "gpt-oss-20b": dict(
        hidden_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        num_local_experts=32,
        num_experts_per_tok=4,
        intermediate_size=2880,
        sliding_window=128,
        vocab_size=201088,
        params=20.91e9,  # OpenAI's model card (the hub card rounds to 21B)
    ),
    "qwen3-next-80b-a3b": dict(
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        num_experts=512,
        num_experts_per_tok=10,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        full_attention_interval=4,
        vocab_size=151936,
        params=80e9,  # without the MTP weights, which the generator does not write
    ),
    "lfm2-8b-a1b": dict(
        hidden_size=2048,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=1792,
        intermediate_size=7168,
        num_dense_layers=2,
        vocab_size=65536,
        params=8.3e9,
    ),
}
NAMES = list(PUBLISHED)
# The scaled copies hold 4 layers; LFM2's first two are dense, so it gets 6 (four routed: three layer pairs), and
# its widths over 8, so its experts (1792 / 8 = 224) fit a quantization group.
LAYERS_OF = {"lfm2-8b-a1b": 6}
SCALE_OF = {"lfm2-8b-a1b": 8}
# Where each family keeps expert 7's down projection in layer `layer` (gpt-oss: all experts in one tensor).
EXPERT_DOWN = {
    "mixtral-8x7b": "model.layers.{layer}.block_sparse_moe.experts.7.w2.weight",
    "minimax-m2": "model.layers.{layer}.block_sparse_moe.experts.7.w2.weight",
    "gpt-oss-20b": "model.layers.{layer}.mlp.experts.down_proj",
    "lfm2-8b-a1b": "model.layers.{layer}.feed_forward.experts.7.w2.weight",
}


def test_every_preset_has_published_numbers():
    assert set(NAMES) == set(PRESETS)


# ----------------------------------------------------------------------------------- full-size shapes (no writing)
@pytest.mark.parametrize("name", NAMES)
def test_full_scale_config_and_shapes_are_the_published_ones(name):
    config, specs, _ = plan(SyntheticOptions(name))
    want = dict(PUBLISHED[name])
    params = want.pop("params")
    assert {k: config.get(k) for k in want} == want
    assert config["torch_dtype"] == "bfloat16"
    total = sum(s.numel for s in specs if s.layer < config["num_hidden_layers"])  # GLM's MTP layer apart
    assert abs(total / params - 1) < 0.01, f"{total / 1e9:.2f} B parameters, the model card says {params / 1e9} B"
    names = {s.name for s in specs}
    expert = EXPERT_DOWN.get(name, "model.layers.{layer}.mlp.experts.7.down_proj.weight")
    assert expert.format(layer=2) in names
    mtp = config.get("num_nextn_predict_layers", 0)
    assert (f"model.layers.{config['num_hidden_layers']}.eh_proj.weight" in names) == (mtp == 1)
    # --layers trims the layer count and nothing else
    n = 4 if name == "lfm2-8b-a1b" else 2  # LFM2's first two layers are dense: the smallest slice with experts
    trimmed = plan(SyntheticOptions(name, layers=n))[0]
    back = {**trimmed, "num_hidden_layers": config["num_hidden_layers"]}
    if "layer_types" in config:  # one entry per layer: trimmed with them
        assert trimmed["layer_types"] == config["layer_types"][:n]
        back["layer_types"] = config["layer_types"]
    assert trimmed["num_hidden_layers"] == n and back == config


def test_scale_and_layers_are_checked():
    with pytest.raises(SyntheticSpecError, match="does not divide"):
        plan(SyntheticOptions("mixtral-8x7b", scale=3))
    with pytest.raises(SyntheticSpecError, match="--layers"):
        plan(SyntheticOptions("olmoe-1b-7b", layers=17))


# ----------------------------------------------------------------------------------------- scaled checkpoints
@pytest.fixture(scope="module")
def written(tmp_path_factory, one_thread):
    transformers.utils.logging.disable_progress_bar()
    root = tmp_path_factory.mktemp("synthetic")
    cache: dict[str, tuple[Path, SyntheticOptions]] = {}

    def get(name: str) -> tuple[Path, SyntheticOptions]:
        if name not in cache:
            opts = SyntheticOptions(
                name,
                layers=LAYERS_OF.get(name, LAYERS),
                scale=SCALE_OF.get(name, SCALE),
                max_shard_bytes=SHARD_BYTES,
                bpe_vocab=512,
                tokenizer_chars=100_000,
            )
            make_synthetic_model(root / name, opts)
            cache[name] = (root / name, opts)
        return cache[name]

    return get


def _prompt(model_dir: Path) -> torch.Tensor:
    tok = Tokenizer(model_dir)
    return torch.tensor([tok.encode("def mean(xs):\n    return sum(xs) / len(xs)\n")[:16]])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.slow
def test_loads_in_fate_edge_and_matches_transformers(written, name):
    path, _ = written(name)
    prompt = _prompt(path)
    ours = load_model(path, dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        ref = hf(prompt).logits
    got = ours(prompt, ours.new_cache())
    assert got.shape == ref.shape == (1, prompt.shape[1], PUBLISHED[name]["vocab_size"])
    assert (got - ref).abs().max().item() <= FP32_ATOL


# gpt-oss's widths over 16 (180) fit no quantization group, and at a scale they fit (2) the copy is 1.6 GB: its store
# is converted from the full-width slice in the bench (docs/results/bench_llamacpp-gpt-oss-20b-*).
@pytest.mark.parametrize("name", ["qwen3-next-80b-a3b", "lfm2-8b-a1b"])
def test_converted_store_computes_the_checkpoints_logits(written, name, tmp_path):
    """The expert store fate-edge converts from the synthetic checkpoint (bf16 experts kept) gives the logits the
    checkpoint itself gives: the converter reads every tensor the generator writes, under the published names."""
    from fate_edge.format.convert import ConvertOptions, convert

    path, _ = written(name)
    prompt = _prompt(path)
    store = convert(path, tmp_path / "store", ConvertOptions.full(bits=4, keep_bf16=True), progress=False)
    ours, want = load_model(store, bits=16), load_model(path)
    assert (ours(prompt, ours.new_cache()) - want(prompt, want.new_cache())).abs().max().item() <= FP32_ATOL


@pytest.mark.parametrize("name", ["qwen1.5-moe-a2.7b", "mixtral-8x7b"])
def test_index_covers_every_tensor_and_bytes_round_trip(written, name):
    path, opts = written(name)
    _, specs, init = plan(opts)
    index = json.loads((path / INDEX_FILE).read_text())
    weight_map = index["weight_map"]
    assert set(weight_map) == {s.name for s in specs}
    shards = sorted(set(weight_map.values()))
    assert len(shards) > 1 and shards == [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
    ]
    stored = 0
    for shard in shards:
        with safe_open(str(path / shard), framework="pt") as f:
            keys = set(f.keys())
            assert keys == {k for k, v in weight_map.items() if v == shard}
            for key in keys:
                sl = f.get_slice(key)
                assert sl.get_dtype() == "BF16"
                stored += math.prod(sl.get_shape()) * 2
    assert stored == index["metadata"]["total_size"] == sum(s.numel for s in specs) * 2
    by_name = {s.name: s for s in specs}
    # one of each kind, the embedding spanning several random blocks
    picks = ["model.embed_tokens.weight", "model.layers.1.post_attention_layernorm.weight", "lm_head.weight"]
    kinds = ("gate.weight", "experts.3.down_proj.weight", "experts.3.w2.weight")
    picks += [n for n in weight_map if n.endswith(kinds)][:2]
    assert by_name[picks[0]].numel > 2 * BLOCK_VALUES
    for key in picks:
        with safe_open(str(path / weight_map[key]), framework="pt") as f:
            on_disk = f.get_tensor(key)
        assert torch.equal(on_disk.view(torch.int16), init.tensor(by_name[key]).view(torch.int16)), key


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v2-lite", "mixtral-8x7b"])
def test_tokenizer_has_the_published_special_ids(written, name):
    path, _ = written(name)
    preset, config = PRESETS[name], json.loads((path / "config.json").read_text())
    tok = Tokenizer(path)
    for text, i in preset.special_tokens.items():
        assert tok.token_to_id(text) == i
    eos = config["eos_token_id"]
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    assert eos in tok.eos_token_ids and max(vocab.values()) < config["vocab_size"]
    text = "for i in range(3):\n    print(i, 'é')\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and all(i < config["vocab_size"] for i in ids)
    assert tok.add_bos == (config.get("bos_token_id") is not None and preset.tokenizer_config["add_bos_token"])
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]).count("hi") == 1


@pytest.mark.parametrize("name", NAMES)
def test_router_structure_is_in_the_trained_model_bands(written, name):
    """Usage entropy per layer in the bundled (trained) model's band, 0.57-0.91 of log E, and the cross-layer
    gate's recall@k 75-90% as for trained models; random routers would give ~1.0 and ~k/E."""
    path, _ = written(name)
    report = measure_router_structure(path, tokens=512)
    assert all(0.57 <= e <= 0.91 for e in report.entropy.values()), report.entropy
    recall = list(report.recall.values())
    assert len(recall) >= 2 and 0.75 <= sum(recall) / len(recall) <= 0.90, report.recall
    assert min(recall) >= 0.70, report.recall


def test_each_checkpoint_gets_its_own_copy_of_the_once_trained_tokenizer(tmp_path):
    """The BPE is trained once per size in a process (every preset the same): a checkpoint written after another
    holds the BPE and its own specials, none of the first one's."""
    from fate_edge_lab.synthetic.tokenizer import write_tokenizer

    vocabs = {}
    for name in ("deepseek-v2-lite", "olmoe-1b-7b", "deepseek-v2-lite"):
        out = tmp_path / str(len(vocabs))
        out.mkdir()
        write_tokenizer(out, PRESETS[name], PRESETS[name].config, 300, 20_000)
        vocabs[out] = (name, json.loads((out / "tokenizer.json").read_text())["model"]["vocab"])
    (_, first), (_, second), (_, again) = vocabs.values()
    assert first == again  # the same size: the same trained BPE
    for name, vocab in vocabs.values():
        assert len(vocab) == 300 + len(PRESETS[name].special_tokens)
        assert {t: vocab[t] for t in PRESETS[name].special_tokens} == PRESETS[name].special_tokens
    assert not set(PRESETS["olmoe-1b-7b"].special_tokens) & set(first)


# ------------------------------------------------------------------------------------------------- streaming
def test_writer_holds_one_block_at_a_time(tmp_path):
    """Blocks handed to the writer are released before the next but one is asked for: memory is one block."""
    _, specs, init = plan(SyntheticOptions("olmoe-1b-7b", layers=1, scale=16))
    alive: list[weakref.ref] = []
    max_alive = 0

    def blocks(spec):
        nonlocal max_alive
        for block in init.blocks(spec):
            max_alive = max(max_alive, sum(r() is not None for r in alive))
            alive.append(weakref.ref(block))
            yield block

    index = write_checkpoint(tmp_path, specs, blocks, max_shard_bytes=4_000_000)
    assert index["metadata"]["total_size"] > 10 * BLOCK_VALUES * 2  # the model is many blocks
    assert len(alive) > 100 and max_alive <= 1


_RSS_PROBE = """
import json, resource, sys, torch
from pathlib import Path
from fate_edge_lab.synthetic import SyntheticOptions, plan
from fate_edge_lab.synthetic.writer import write_checkpoint
torch.set_num_threads(1)
_, specs, init = plan(SyntheticOptions("qwen1.5-moe-a2.7b", layers=1, scale=8))
init.routing(0)  # the router design's Monte-Carlo (a few MB), before the baseline
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
index = write_checkpoint(Path(sys.argv[1]), specs, init.blocks, max_shard_bytes=50_000_000)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
biggest = max(s.numel for s in specs) * 4
print(json.dumps(dict(growth=after - before, total=index["metadata"]["total_size"], biggest_fp32=biggest)))
"""


@pytest.mark.slow
def test_generator_peak_memory_does_not_grow_with_model_size(tmp_path):
    out = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(tmp_path)], capture_output=True, text=True, check=True)
    m = json.loads(out.stdout)
    assert m["total"] > 150e6 and m["biggest_fp32"] > 150e6
    # Peak RSS grows by a few blocks, not by the model (150+ MB) nor by its largest tensor in fp32.
    assert m["growth"] < 48e6, m


def test_resident_bits_quantize_mla_projections(written):
    """DeepSeek's MLA projections are quantized with the rest under --resident-bits 4 (they stayed bf16, and its
    decode ran at 0.67x llama.cpp's q4_0 mix, which quantizes them): no float weight is left but ``kv_b_proj``, which
    decode multiplies from the other side (the absorbed form: tests/test_mla_decode.py), and the logits stay close."""
    path, _ = written("deepseek-v2-lite")
    prompt = _prompt(path)
    ref_model = load_model(path, dtype=torch.float32)
    ref = ref_model(prompt, ref_model.new_cache())
    attn = ref_model.names[0].attn
    projections = [k for k in ref_model.w if k.startswith(attn) and k.endswith("proj.weight") and "o_proj" not in k]
    kv_b = f"{attn}.kv_b_proj.weight"
    quantized = [k for k in projections if k != kv_b]
    # int8 checks the wiring tightly (1% measured); int4 on this tiny random model costs 14% with or without MLA
    for bits, tol in ((8, 0.03), (4, 0.25)):
        model = load_model(path, dtype=torch.float32, resident_bits=bits)
        assert kv_b in projections and quantized and not any(k in model.w for k in quantized)
        assert isinstance(model.plan()[0].mla["kv_b_proj"].weight, torch.Tensor)
        got = model(prompt, model.new_cache())
        assert (got - ref).pow(2).mean().sqrt() < tol * ref.pow(2).mean().sqrt()


@pytest.mark.slow
def test_fate_edge_synth_writes_what_the_library_writes(tmp_path, capsys):
    from fate_edge.apps.cli import main

    assert main(["synth", str(tmp_path / "cli"), "--like", "olmoe-1b-7b", "--scale", "16", "--layers", "1"]) == 0
    assert "olmoe-1b-7b: " in capsys.readouterr().out
    make_synthetic_model(tmp_path / "lib", SyntheticOptions("olmoe-1b-7b", layers=1, scale=16))
    files = sorted(p.name for p in (tmp_path / "lib").iterdir())
    assert sorted(p.name for p in (tmp_path / "cli").iterdir()) == files
    for name in files:
        if name.endswith((".safetensors", ".json")):
            assert (tmp_path / "cli" / name).read_bytes() == (tmp_path / "lib" / name).read_bytes(), name
