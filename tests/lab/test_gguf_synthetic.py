"""GGUFs of synthetic real-architecture checkpoints (fate_edge_lab.bench.gguf on fate_edge_lab.synthetic models).

Tiny copies (widths / 32, or / 16 where 32 leaves widths no int4 group divides; 2 layers) of every preset are
converted to f32 (and f16) by llama.cpp's own converter with fate-edge's patches; the GGUF must hold every
checkpoint weight (experts stacked per layer, the same values), fate-edge's store of it must compute the
checkpoint's and transformers' logits, and
llama.cpp must tokenize held-out text to fate-edge's ids and compute fate-edge's logits. The converter and
llama-cpp-python are optional peers: without the sdist or the package these skip with the reason.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from fate_edge import Tokenizer, load_model
from fate_edge.errors import ModelFormatError
from fate_edge.format.convert import ConvertOptions
from fate_edge.format.gguf_convert import convert_gguf
from fate_edge.format.gguf_reader import GGUFFile
from fate_edge_lab.bench import gguf
from fate_edge_lab.synthetic import PRESETS, SyntheticOptions, make_synthetic_model

SCALE, LAYERS = 32, 2
# llama.cpp's KV cache in f32, not its default f16: ERNIE's logits (up to ~175 here) move by 7e-3 through an f16 cache
F32_KV = {"type_k": 0, "type_v": 0}  # GGML_TYPE_F32
SCALES = {"ernie-4.5-21b-a3b": 16, "minimax-m2": 16}  # hidden 2560 / 32 = 80, expert 1536 / 32 = 48: no group


class _FakeDeepseek:
    def __init__(self, hparams):
        self.hparams = hparams
        self.written: dict[str, int] = {}
        self.gguf_writer = self

    def add_q_lora_rank(self, n: int) -> None:
        self.written["q_lora_rank"] = n

    def set_gguf_parameters(self) -> None:  # the converter writes the key only when the rank is set
        if self.hparams.get("q_lora_rank") is not None:
            self.add_q_lora_rank(self.hparams["q_lora_rank"])


def test_mla_without_q_lora_gets_rank_zero_and_a_set_rank_is_kept():
    cls = type("D", (_FakeDeepseek,), {})
    m = cls({"q_lora_rank": None})
    m.set_gguf_parameters()
    assert m.written == {}  # llama.cpp would demand the key of a DeepSeek-V2 not 26/27 layers deep
    gguf.patch_mla_without_q_lora(cls)
    gguf.patch_mla_without_q_lora(cls)  # idempotent
    m = cls({"q_lora_rank": None})
    m.set_gguf_parameters()
    assert m.written == {"q_lora_rank": 0}
    m = cls({"q_lora_rank": 1536})
    m.set_gguf_parameters()
    assert m.written == {"q_lora_rank": 1536}


class _FakeQwenMoe:
    """The converter's view of a tensor: its own rule forces nothing (False), names match by the ggml name."""

    def tensor_force_quant(self, name, new_name, bid, n_dims):
        return False

    def match_model_tensor_name(self, new_name, key, bid):
        return new_name == (f"{key}.weight" if bid is None else f"blk.{bid}.{key}.weight")


def test_q4_0_mix_quantizes_the_matrices_llama_cpp_would_and_leaves_routers_and_output():
    from types import SimpleNamespace

    kinds = SimpleNamespace(**{k: k.lower() for k in gguf.Q4_0_MIX_KEPT})
    fake_gguf = SimpleNamespace(MODEL_TENSOR=kinds, GGMLQuantizationType=SimpleNamespace(Q4_0="Q4_0"))
    cls = type("Q", (_FakeQwenMoe,), {})
    gguf.patch_q4_0_mix(cls, fake_gguf)
    gguf.patch_q4_0_mix(cls, fake_gguf)  # idempotent
    m = cls()
    got = {
        new: m.tensor_force_quant("hf." + new, new, bid, dims)
        for new, bid, dims in [
            ("blk.0.attn_q.weight", 0, 2),
            ("blk.0.ffn_gate_exps.weight", 0, 3),
            ("blk.0.ffn_down_shexp.weight", 0, 2),
            ("token_embd.weight", None, 2),
            ("blk.0.ffn_gate_inp.weight", 0, 2),
            ("blk.0.ffn_gate_inp_shexp.weight", 0, 2),
            ("output.weight", None, 2),
            ("blk.0.attn_norm.weight", 0, 1),
            ("blk.0.attn_q.bias", 0, 1),
            ("blk.0.shortconv_conv.weight", 0, 2),  # conv kernels (LFM2, DeltaNet): ggml's ssm_conv reads F32
            ("blk.0.ssm_conv1d.weight", 0, 2),
        ]
    }
    assert [k for k, v in got.items() if v == "Q4_0"] == [
        "blk.0.attn_q.weight",
        "blk.0.ffn_gate_exps.weight",
        "blk.0.ffn_down_shexp.weight",
        "token_embd.weight",
    ]
    # routers and conv kernels F32, output bf16 by the converter's own rules
    assert sum(v is False for v in got.values()) == 7


def test_no_mtp_flag_only_for_a_qwen3_next_checkpoint_without_mtp_tensors(tmp_path):
    """llama.cpp's Qwen3-Next converter asserts on a checkpoint without mtp.* tensors unless given --no-mtp."""
    import json

    from safetensors.torch import save_file

    def checkpoint(name: str, model_type: str, tensors: list[str]) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": model_type}))
        save_file({t: torch.zeros(2) for t in tensors}, str(d / "model.safetensors"))
        return d

    bare = checkpoint("bare", "qwen3_next", ["model.norm.weight"])
    with_mtp = checkpoint("mtp", "qwen3_next", ["model.norm.weight", "mtp.fc.weight"])
    glm = checkpoint("glm", "glm4_moe", ["model.norm.weight"])
    assert gguf.mtp_flags(bare) == ["--no-mtp"]
    assert gguf.mtp_flags(with_mtp) == [] and gguf.mtp_flags(glm) == []
    assert gguf.convert_command(bare, "f32", tmp_path / "o.gguf", tmp_path)[-1] == "--no-mtp"


def test_sentencepiece_probe_needs_no_sentencepiece_without_a_tokenizer_model(tmp_path):
    class Fake:
        dir_model = tmp_path

        def _create_vocab_sentencepiece(self):
            raise ModuleNotFoundError("No module named 'sentencepiece'")  # the import the converter does first

    with pytest.raises(ModuleNotFoundError):
        Fake()._create_vocab_sentencepiece()
    gguf.patch_sentencepiece_probe(Fake)
    with pytest.raises(FileNotFoundError):  # the converter's own fallback to the Hugging Face BPE follows
        Fake()._create_vocab_sentencepiece()
    (tmp_path / "tokenizer.model").write_bytes(b"")
    with pytest.raises(ModuleNotFoundError):  # a real SentencePiece model still goes to the original
        Fake()._create_vocab_sentencepiece()


def test_q4_0_is_quantized_from_bf16_unless_f32_is_there(tmp_path, monkeypatch):
    monkeypatch.setenv("FATE_EDGE_PEERS_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert gguf.quantize_source(model, ("bf16", "q4_0")) == "bf16"
    assert gguf.quantize_source(model, ("f32", "bf16", "q4_0")) == "f32"
    f32 = gguf.gguf_path(model, "f32")
    f32.parent.mkdir(parents=True)
    f32.write_bytes(b"")
    assert gguf.quantize_source(model, ("bf16", "q4_0")) == "f32"


@pytest.fixture(scope="module")
def converter():
    try:
        return gguf.converter_dir()
    except gguf.PeerUnavailableError as exc:
        pytest.skip(str(exc))


# Presets with a setting their family's other releases have: GLM-4.5 and 4.6 (not Air) norm q and k per head
VARIANTS = {"glm-4.5-air+qk_norm": ("glm-4.5-air", {"use_qk_norm": True})}


# Not here: gpt-oss (its widths over 32, 90, fit no quantization group), LFM2-8B-A1B (2 layers are all dense) and
# Qwen3-Next (2 layers hold no attention layer, on which llama.cpp 0.3.36 aborts). Their GGUF route is tested on
# transformers-built checkpoints: tests/lab/test_gguf_recurrent_converter.py, tests/test_gpt_oss_store_cli.py.
OWN_GGUF_TESTS = {"gpt-oss-20b", "lfm2-8b-a1b", "qwen3-next-80b-a3b"}


@pytest.fixture(scope="module", params=sorted(set(PRESETS) - OWN_GGUF_TESTS) + sorted(VARIANTS))
def converted(request, converter, tmp_path_factory):
    """A tiny synthetic checkpoint of one preset and its f32 GGUF (the converter run as ensure_ggufs runs it)."""
    import subprocess

    name, changes = VARIANTS.get(request.param, (request.param, {}))
    out = tmp_path_factory.mktemp(request.param)
    model = out / "model"
    preset = PRESETS[name]
    config = {**preset.config, **changes}
    scale = SCALES.get(name, SCALE)
    if config.get("moe_intermediate_size", 32 * scale) // scale % 32:  # 1408 / 32 = 44: no int4 group divides
        config["moe_intermediate_size"] = 2048
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(PRESETS, name, replace(preset, config=config))
        make_synthetic_model(
            model, SyntheticOptions(name, LAYERS, scale=scale, bpe_vocab=1024, tokenizer_chars=200_000)
        )
    path = out / "model-f32.gguf"
    proc = subprocess.run(gguf.convert_command(model, "f32", path, converter), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    if changes.get("use_qk_norm"):
        assert "blk.1.attn_q_norm.weight" in GGUFFile(path).tensors  # the variant is exercised
    return name, model, path


def _stack(model, layer: int, part: str) -> np.ndarray:
    return torch.stack([getattr(model.experts.get(layer, e), part) for e in range(model.config.num_experts)]).numpy()


@pytest.mark.slow
def test_every_checkpoint_weight_lands_in_the_gguf(converted):
    name, model_dir, path = converted
    reader = gguf.read_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    model = load_model(model_dir, torch.float32)
    cfg = model.config
    n_ckpt = 0
    for shard in model_dir.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            n_ckpt += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert sum(int(t.n_elements) for t in tensors.values()) == n_ckpt, name  # nothing dropped, nothing twice
    np.testing.assert_array_equal(tensors["token_embd.weight"].data, model.embed.numpy())
    for i in cfg.moe_layers:
        for part, gg in (("gate", "ffn_gate_exps"), ("up", "ffn_up_exps"), ("down", "ffn_down_exps")):
            t = tensors[f"blk.{i}.{gg}.weight"]
            want = _stack(model, i, part)  # [E, out, in]; ggml lists dimensions innermost first
            assert list(t.shape) == list(reversed(want.shape)), (name, gg)
            np.testing.assert_array_equal(t.data, want)
    if cfg.mla is not None:  # DeepSeek's kv_b_proj is split into k_b (transposed per head) and v_b
        assert f"blk.{LAYERS - 1}.attn_k_b.weight" in tensors and f"blk.{LAYERS - 1}.attn_v_b.weight" in tensors
    arch = reader.fields["general.architecture"].contents()
    assert reader.fields["tokenizer.ggml.pre"].contents() == gguf.FALLBACK_PRE_TOKENIZER
    assert (
        arch
        == {
            "olmoe-1b-7b": "olmoe",
            "qwen1.5-moe-a2.7b": "qwen2moe",
            "mixtral-8x7b": "llama",
            "deepseek-v2-lite": "deepseek2",
            "qwen3-30b-a3b": "qwen3moe",
            "glm-4.5-air": "glm4moe",
            "ernie-4.5-21b-a3b": "ernie4_5-moe",
            "minimax-m2": "minimax-m2",
        }[name]
    )


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
@pytest.mark.slow
def test_llama_cpp_tokenizes_and_computes_like_fate_edge(converted, one_thread):
    from llama_cpp import Llama

    from fate_edge.corpus import heldout_source
    from fate_edge_lab.bench.llamacpp import tokens_agree

    name, model_dir, path = converted
    tok = Tokenizer(model_dir)
    text, _ = heldout_source(1500)
    ids = tok.encode(text)
    llm = Llama(model_path=str(path), n_ctx=128, n_threads=1, logits_all=True, verbose=False, **F32_KV)
    assert tokens_agree(llm, text, ids)["equal"], name
    prompt = ids[:48]
    llm.eval(prompt)
    theirs = np.array(llm.scores[: len(prompt)])
    model = load_model(model_dir, torch.float32)
    with torch.no_grad():
        ours = model(torch.tensor([prompt]), model.new_cache())[0].numpy()
    np.testing.assert_allclose(theirs, ours, atol=5e-3, rtol=0, err_msg=name)


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_the_gguf_converts_to_a_store_that_tokenizes_and_computes_like_llama_cpp(converted, one_thread, tmp_path):
    """The f32 GGUF llama.cpp's converter wrote, converted by ``fate-edge convert``: Mixtral's q/k rows un-permuted,
    DeepSeek's kv_b_proj rebuilt from k_b/v_b, the tokenizer rebuilt from the metadata. The store's ids are
    llama.cpp's on held-out text, and its logits (bf16 experts: the synthetic weights are bf16, so exact) are the
    checkpoint's own and llama.cpp's on the same ids."""
    from llama_cpp import Llama

    from fate_edge.corpus import heldout_source

    name, model_dir, path = converted
    store = convert_gguf(path, tmp_path / "store", ConvertOptions.full(bits=None), progress=False)
    tok, ref_tok = Tokenizer(store), Tokenizer(model_dir)
    text, _ = heldout_source(3000)
    ids = tok.encode(text)
    assert ids == ref_tok.encode(text) and tok.add_bos == ref_tok.add_bos, name
    llm = Llama(model_path=str(path), n_ctx=128, n_threads=1, logits_all=True, verbose=False, **F32_KV)
    assert llm.tokenize(text.encode(), add_bos=False, special=False) == tok.encode(text, add_special_tokens=False)
    prompt = ids[:48]
    llm.eval(prompt)
    theirs = np.array(llm.scores[: len(prompt)])
    with torch.no_grad():
        model = load_model(store, torch.float32, bits=16)
        ours = model(torch.tensor([prompt]), model.new_cache())[0].numpy()
        model.experts.close()
        reference = load_model(model_dir, torch.float32)
        ckpt = reference(torch.tensor([prompt]), reference.new_cache())[0].numpy()
    np.testing.assert_allclose(ours, ckpt, atol=1e-4, rtol=0, err_msg=name)
    cos = (ours * theirs).sum(-1) / np.linalg.norm(ours, axis=-1) / np.linalg.norm(theirs, axis=-1)
    assert cos.min() >= 0.9999, (name, cos.min())
    np.testing.assert_allclose(ours, theirs, atol=5e-3, rtol=0, err_msg=name)


def test_bf16_checkpoints_get_the_real_side_set_and_their_own_results_file(tmp_path):
    from fate_edge import bundled_model_dir
    from fate_edge_lab.bench import sidebyside as sbs
    from fate_edge_lab.bench.publish import publish, results_file

    model = tmp_path / "olmoe-2l"
    model.mkdir()
    (model / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    real = sbs.pick_side_set("auto", model)
    assert real is sbs.SIDE_SETS["real"] and "f32" not in real.gguf_types
    assert {s.resident_bits for s in real.resident if s.kind == "fate-edge"} == {None, 8, 4}
    assert sbs.pick_side_set("auto", bundled_model_dir()) is sbs.SIDE_SETS["small"]  # an fp32 checkpoint
    assert sbs.readme_marker(bundled_model_dir(), 2) == "bench_llamacpp"  # docs/results/bench_llamacpp.md
    assert sbs.readme_marker(model, 1) == "bench_llamacpp-olmoe-2l-1t" != sbs.readme_marker(model, 2)
    assert results_file("bench_llamacpp-olmoe-2l-1t") == Path("docs/results/bench_llamacpp-olmoe-2l-1t.md")
    results = tmp_path / "docs" / "results" / "bench_llamacpp-olmoe-2l-1t.md"
    sbs.add_markers(results, "bench_llamacpp-olmoe-2l-1t")  # a new model's file is created with its markers
    sbs.add_markers(results, "bench_llamacpp-olmoe-2l-1t")  # once only
    assert results.read_text() == "<!-- bench_llamacpp-olmoe-2l-1t:begin -->\n<!-- bench_llamacpp-olmoe-2l-1t:end -->\n"
    kept = tmp_path / "kept.md"
    kept.write_text("# title\ntext")
    sbs.add_markers(kept, "bench_llamacpp-olmoe-2l-1t")  # a file without them gets them at its end
    doc = kept.read_text()
    assert doc.startswith("# title\ntext\n") and doc.count("<!-- bench_llamacpp-olmoe-2l-1t:begin -->") == 1
    publish({}, tmp_path / "r.json", "| T |", results, "bench_llamacpp-olmoe-2l-1t")
    assert "| T |" in results.read_text() and results.read_text().endswith("<!-- bench_llamacpp-olmoe-2l-1t:end -->\n")


@pytest.fixture(scope="module")
def converted_f16(converted, converter):
    """The same checkpoint's f16 GGUF (bf16 weights: f16 holds every one of them but the tiniest exactly)."""
    import subprocess

    name, model, _ = converted
    path = model.parent / "model-f16.gguf"
    if not path.exists():
        proc = subprocess.run(gguf.convert_command(model, "f16", path, converter), capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
    return name, model, path


CODE = "def f(x):\n    return [y * 2 for y in x if y % 3]\n"


@pytest.fixture(scope="module")
def reference_logits(converted, one_thread):
    """The checkpoint's logits on CODE, computed by fate-edge and by transformers: once per preset, for both GGUFs."""
    import transformers

    name, model_dir, _ = converted
    ids = Tokenizer(model_dir).encode(CODE)
    with torch.no_grad():
        reference = load_model(model_dir, torch.float32)
        ckpt = reference(torch.tensor([ids]), reference.new_cache())[0]
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        theirs = hf(torch.tensor([ids])).logits[0]
    return ids, ckpt, theirs


@pytest.fixture(scope="module")
def f32_store(converted, tmp_path_factory):
    """``fate-edge convert`` of the f32 GGUF, once a preset: the tests below only read it."""
    name, _, path = converted
    out = tmp_path_factory.mktemp(f"{name}-store") / "store"
    return convert_gguf(path, out, ConvertOptions.full(bits=None), progress=False)


def _computes_like_the_checkpoint(name: str, store: Path, reference_logits, kind: str) -> None:
    ids, ckpt, theirs = reference_logits
    with torch.no_grad():
        model = load_model(store, torch.float32, bits=16)
        ours = model(torch.tensor([ids]), model.new_cache())[0]
        model.experts.close()
    # f16 holds bf16 weights exactly but for the subnormal ones (below 6e-5): 3e-5 on ERNIE's logits
    within = {"f32": 1e-5, "f16": 1e-4}[kind]
    assert (ours - ckpt).abs().max() <= within, (name, kind)
    assert (ours - theirs).abs().max() <= 1e-4 + within, (name, kind)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1)), (name, kind)


@pytest.mark.slow
def test_the_gguf_store_computes_like_the_checkpoint_and_transformers(converted, f32_store, reference_logits):
    """The GGUF llama.cpp's converter wrote, converted by ``fate-edge convert``, computes the checkpoint's logits
    (loaded by fate-edge) and transformers' on the same checkpoint: GLM-4.5's MTP layer skipped and its
    post-attention norm found, ERNIE-4.5's [1, E] selection bias, MiniMax-M2's rotary width, ..."""
    _computes_like_the_checkpoint(converted[0], f32_store, reference_logits, "f32")


# The f16 GGUF differs from the f32 one only in the float type of its matrices, which the reader widens the same way
# for every architecture: checked on the presets whose matrices fate-edge rewrites from llama.cpp's (Mixtral's q/k
# rows un-permuted, DeepSeek's kv_b_proj rebuilt from k_b/v_b) and on ERNIE's, whose logits feel f16's subnormals.
F16_PRESETS = ["deepseek-v2-lite", "ernie-4.5-21b-a3b", "mixtral-8x7b"]


@pytest.mark.slow
@pytest.mark.parametrize("converted", F16_PRESETS, indirect=True)
def test_the_f16_gguf_store_computes_like_the_checkpoint_and_transformers(
    converted, converted_f16, reference_logits, tmp_path
):
    """The same from the f16 GGUF (bf16 weights: f16 holds every one of them but the tiniest exactly)."""
    name, _, path = converted_f16
    store = convert_gguf(path, tmp_path / "store", ConvertOptions.full(bits=None), progress=False)
    _computes_like_the_checkpoint(name, store, reference_logits, "f16")


def _parsed(path: Path):
    from _gguf_rewrite import parse

    return parse(path)


def _bad_copy(src, out: Path, **changes) -> Path:
    """``src`` (a GGUF parsed once for a test's several copies: rewrite only reads it) written again with metadata
    keys changed (None: removed)."""
    from _gguf_rewrite import rewrite

    fields = {k: v for k, v in src.header.fields.items() if changes.get(k, 0) is not None}
    fields.update({k: v for k, v in changes.items() if v is not None})
    return rewrite(src, out, fields)


def _refused(path: Path, out: Path) -> str:
    with pytest.raises(ModelFormatError) as err:
        convert_gguf(path, out, progress=False)
    assert not out.exists()  # nothing written at the target
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("converted", ["glm-4.5-air"], indirect=True)
def test_glm_block_count_holds_the_mtp_layer_which_is_not_run(converted, f32_store, tmp_path):
    import json

    _, model_dir, path = converted
    g = GGUFFile(path)
    assert g.fields["glm4moe.block_count"] == LAYERS + 1 and g.fields["glm4moe.nextn_predict_layers"] == 1
    assert f"blk.{LAYERS}.nextn.eh_proj.weight" in g.tensors and f"blk.{LAYERS}.ffn_gate_exps.weight" in g.tensors
    cfg = json.loads((f32_store / "config.json").read_text())
    assert cfg["num_hidden_layers"] == LAYERS and cfg["num_nextn_predict_layers"] == 0
    assert cfg["first_k_dense_replace"] == 1 and cfg["partial_rotary_factor"] == 0.5
    # without the count the MTP layer's own tensors are named: they are not a decoder layer's
    src = _parsed(path)
    msg = _refused(_bad_copy(src, tmp_path / "a.gguf", **{"glm4moe.nextn_predict_layers": None}), tmp_path / "o")
    assert f"blk.{LAYERS}.nextn." in msg
    msg = _refused(_bad_copy(src, tmp_path / "b.gguf", **{"glm4moe.nextn_predict_layers": 3}), tmp_path / "o")
    assert "glm4moe.nextn_predict_layers" in msg and "3" in msg
    msg = _refused(_bad_copy(src, tmp_path / "c.gguf", **{"glm4moe.leading_dense_block_count": 0}), tmp_path / "o")
    assert "glm4moe.leading_dense_block_count" in msg


@pytest.mark.parametrize("converted", ["minimax-m2"], indirect=True)
def test_minimax_rotary_width_is_read_and_a_bad_one_is_named(converted, f32_store, tmp_path):
    import json

    _, _, path = converted
    assert json.loads((f32_store / "config.json").read_text())["partial_rotary_factor"] == 0.5
    src = _parsed(path)
    for bad in (5, 64, "x"):
        msg = _refused(_bad_copy(src, tmp_path / "m.gguf", **{"minimax-m2.rope.dimension_count": bad}), tmp_path / "o")
        assert "minimax-m2.rope.dimension_count" in msg


@pytest.mark.parametrize("converted", ["ernie-4.5-21b-a3b"], indirect=True)
def test_ernie_moe_layers_follow_the_routers_and_a_contradiction_is_named(converted, tmp_path):
    _, _, path = converted
    msg = _refused(
        _bad_copy(_parsed(path), tmp_path / "e.gguf", **{"ernie4_5-moe.leading_dense_block_count": 0}), tmp_path / "o"
    )
    assert "ernie4_5-moe.leading_dense_block_count" in msg and "ffn_gate_inp" in msg
