"""GGUF input of LFM2-MoE (llama.cpp's ``lfm2moe``) without llama.cpp: the ``gguf`` package writes a tiny random
checkpoint under the names and metadata llama.cpp's converter gives it (``conversion/lfm2.py``: the convolution
layers have no key/value heads, the convolution weight squeezed to [H, L], the final norm as ``token_embd_norm``,
the expert bias as ``exp_probs_b.bias``), q8_0 experts; fate-edge converts it, and the store equals the one
converted from the safetensors checkpoint with ggml's q8_0 rounding: the same expert bytes, the same logits."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from _gguf_reference import reference_store
from _gguf_writer import _quantize
from _tiny_recurrent import _BASE, save_tiny

transformers = pytest.importorskip("transformers")
from gguf import ExpertGatingFuncType, GGMLQuantizationType, GGUFWriter  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from fate_edge.format.convert import ConvertOptions  # noqa: E402
from fate_edge.format.gguf_convert import convert_gguf  # noqa: E402
from fate_edge.model.arch import load_config  # noqa: E402
from fate_edge.runtime.loader import load_model  # noqa: E402

F32, Q8 = GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0
_LAYER = {
    "operator_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "conv.in_proj.weight": "shortconv.in_proj.weight",
    "conv.out_proj.weight": "shortconv.out_proj.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.out_proj.weight": "attn_output.weight",
    "self_attn.q_layernorm.weight": "attn_q_norm.weight",
    "self_attn.k_layernorm.weight": "attn_k_norm.weight",
    "feed_forward.w1.weight": "ffn_gate.weight",
    "feed_forward.w3.weight": "ffn_up.weight",
    "feed_forward.w2.weight": "ffn_down.weight",
    "feed_forward.gate.weight": "ffn_gate_inp.weight",
    "feed_forward.expert_bias": "exp_probs_b.bias",
}


def write_lfm2_gguf(model_dir: Path, out: Path) -> Path:
    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    w = {k: v.float().numpy() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    g = GGUFWriter(str(out), "lfm2moe")
    g.add_block_count(cfg["num_hidden_layers"])
    g.add_context_length(cfg["max_position_embeddings"])
    g.add_embedding_length(cfg["hidden_size"])
    g.add_feed_forward_length(cfg["intermediate_size"])
    g.add_head_count(cfg["num_attention_heads"])
    g.add_head_count_kv([cfg["num_key_value_heads"] if t == "full_attention" else 0 for t in cfg["layer_types"]])
    g.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    g.add_layer_norm_rms_eps(cfg["norm_eps"])
    g.add_expert_count(cfg["num_experts"])
    g.add_expert_used_count(cfg["num_experts_per_tok"])
    g.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    g.add_leading_dense_block_count(cfg["num_dense_layers"])
    g.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    g.add_shortconv_l_cache(cfg["conv_L_cache"])
    vocab = tok["model"]["vocab"]
    g.add_tokenizer_model("gpt2")
    g.add_tokenizer_pre("gpt-2")
    g.add_token_list([t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])])
    g.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    g.add_add_bos_token(False)

    def add(name: str, x: np.ndarray, qtype: GGMLQuantizationType = F32) -> None:
        g.add_tensor(name, _quantize(x, qtype), raw_dtype=None if qtype == F32 else qtype)

    add("token_embd.weight", w.pop("model.embed_tokens.weight"))
    add("token_embd_norm.weight", w.pop("model.embedding_norm.weight"))
    add("output.weight", w.pop("lm_head.weight"))
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        if f"{pre}feed_forward.experts.0.w1.weight" in w:  # llama.cpp stacks the per-expert matrices
            for hf, gg in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
                stacked = [w.pop(f"{pre}feed_forward.experts.{e}.{hf}.weight") for e in range(cfg["num_experts"])]
                add(f"blk.{i}.ffn_{gg}_exps.weight", np.stack(stacked), Q8)
        if f"{pre}conv.conv.weight" in w:
            add(f"blk.{i}.shortconv.conv.weight", w.pop(f"{pre}conv.conv.weight")[:, 0])  # squeezed, as llama.cpp
        for key in sorted(k for k in w if k.startswith(pre)):
            add(f"blk.{i}.{_LAYER[key[len(pre) :]]}", w.pop(key))
    assert not w, f"tensors left unwritten: {sorted(w)[:5]}"
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()
    return out


def _expert_bias(name: str, t: torch.Tensor) -> None:
    if name.endswith("expert_bias"):  # zeros by default: make the selection-only bias bite
        t.copy_(torch.randn_like(t) * 0.2)


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("lfm2_gguf") / "hf"
    layers = dict(num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "full_attention"])
    config = transformers.Lfm2MoeConfig(**dict(_BASE, **layers, intermediate_size=96, num_dense_layers=1))
    save_tiny(config, d, _expert_bias)
    return d


def _logits(store: Path, ids: torch.Tensor) -> torch.Tensor:
    model = load_model(store, torch.float32, bits=8)
    try:
        cache = model.new_cache()
        prompt = model(ids[:, :-1], cache)
        step = model(ids[:, -1:], cache)  # the states carried into a decode step
        return torch.cat([prompt, step], dim=1)[0]
    finally:
        model.experts.close()


@pytest.mark.slow
def test_lfm2moe_gguf_converts_to_the_store_of_the_same_q8_0_weights(lfm2: Path, tmp_path: Path):
    gguf = write_lfm2_gguf(lfm2, tmp_path / "lfm2.gguf")
    ours = convert_gguf(gguf, tmp_path / "from-gguf", ConvertOptions.full(bits=None, keep_bf16=False), progress=False)
    ref = reference_store(lfm2, tmp_path / "from-safetensors", "q8_0")
    a, b = load_config(ours), load_config(ref)
    assert a.model_type == "lfm2_moe" and a.layer_types == b.layer_types == ("conv", "attention", "conv", "attention")
    assert (a.conv_kernel, a.dense_layers, a.norm_topk_prob) == (b.conv_kernel, b.dense_layers, b.norm_topk_prob)
    assert (ours / "experts-8.bin").read_bytes() == (ref / "experts-8.bin").read_bytes()
    ids = torch.randint(0, 4096, (1, 10), generator=torch.Generator().manual_seed(7))
    assert torch.equal(_logits(ours, ids), _logits(ref, ids))


# ------------------------------------------------------------------------------------------------- Qwen3-Next
def write_qwen3_next_gguf(model_dir: Path, out: Path, arch: str = "qwen3next") -> Path:
    """``model_dir`` as llama.cpp's ``Qwen3NextModel`` converter writes it (conversion/qwen.py): in_proj_qkvz
    regrouped into attn_qkv ([q; k; v] over all key heads) and attn_gate (z), A_log as -exp(A_log), dt_bias as
    ssm_dt.bias, the convolution squeezed, 1 added to every RMSNorm but the DeltaNet's gated one. ``qwen35moe``
    (``Qwen3_5MoeTextModel``): the projections apart (attn_qkv, attn_gate, ssm_beta, ssm_alpha), each DeltaNet
    tensor's value heads first reordered from grouped by key head to tiled (``_LinearAttentionVReorderBase``)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    w = {k: v.float().numpy() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    nk, nv, dk, dv = (
        cfg[k]
        for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    )
    g = GGUFWriter(str(out), arch)
    g.add_block_count(cfg["num_hidden_layers"])
    g.add_context_length(cfg["max_position_embeddings"])
    g.add_embedding_length(cfg["hidden_size"])
    if cfg.get("intermediate_size"):
        g.add_feed_forward_length(cfg["intermediate_size"])
    g.add_head_count(cfg["num_attention_heads"])
    g.add_head_count_kv(cfg["num_key_value_heads"])
    g.add_key_length(cfg["head_dim"])
    g.add_value_length(cfg["head_dim"])
    g.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    g.add_rope_dimension_count(int(cfg["head_dim"] * cfg["rope_parameters"]["partial_rotary_factor"]))
    g.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    g.add_expert_count(cfg["num_experts"])
    g.add_expert_used_count(cfg["num_experts_per_tok"])
    g.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    g.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    g.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    g.add_ssm_state_size(dk)
    g.add_ssm_group_count(nk)
    g.add_ssm_time_step_rank(nv)
    g.add_ssm_inner_size(dv * nv)
    g.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in cfg["layer_types"]])
    g.add_full_attention_interval(4)
    vocab = tok["model"]["vocab"]
    g.add_tokenizer_model("gpt2")
    g.add_tokenizer_pre("gpt-2")
    g.add_token_list([t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])])
    g.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    g.add_add_bos_token(False)

    def add(name: str, x: np.ndarray, qtype: GGMLQuantizationType = F32) -> None:
        g.add_tensor(name, _quantize(np.ascontiguousarray(x), qtype), raw_dtype=None if qtype == F32 else qtype)

    add("token_embd.weight", w.pop("model.embed_tokens.weight"))
    add("output_norm.weight", w.pop("model.norm.weight") + 1)
    add("output.weight", w.pop("lm_head.weight"))
    names = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.k_norm.weight": "attn_k_norm.weight",
        "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
        "linear_attn.norm.weight": "ssm_norm.weight",
        "linear_attn.out_proj.weight": "ssm_out.weight",
        "linear_attn.dt_bias": "ssm_dt.bias",
        "mlp.gate.weight": "ffn_gate_inp.weight",
        "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    }
    for m in ("gate", "up", "down"):
        names[f"mlp.shared_expert.{m}_proj.weight"] = f"ffn_{m}_shexp.weight"
        names[f"mlp.{m}_proj.weight"] = f"ffn_{m}.weight"
    r = nv // nk

    def tile(x: np.ndarray, axis: int, width: int, skip: int = 0) -> np.ndarray:
        """llama.cpp's _reorder_v_heads: value heads grouped by key head -> tiled (past ``skip`` q/k channels)."""
        x = np.moveaxis(x, axis, 0)
        rest = x[skip:].reshape(nk, r, width, *x.shape[1:]).swapaxes(0, 1).reshape(x[skip:].shape)
        return np.moveaxis(np.concatenate([x[:skip], rest]), 0, axis)

    if arch == "qwen35moe":
        qk = 2 * nk * dk
        for i in range(cfg["num_hidden_layers"]):
            la = f"model.layers.{i}.linear_attn."
            if f"{la}in_proj_qkv.weight" not in w:
                continue
            for key, axis, width, skip in (
                ("in_proj_qkv.weight", 0, dv, qk),
                ("in_proj_z.weight", 0, dv, 0),
                ("in_proj_b.weight", 0, 1, 0),
                ("in_proj_a.weight", 0, 1, 0),
                ("A_log", 0, 1, 0),
                ("dt_bias", 0, 1, 0),
                ("conv1d.weight", 0, dv, qk),
                ("out_proj.weight", 1, dv, 0),
            ):
                w[la + key] = tile(w[la + key], axis, width, skip)
        names |= {
            "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
            "linear_attn.in_proj_z.weight": "attn_gate.weight",
            "linear_attn.in_proj_b.weight": "ssm_beta.weight",
            "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
        }
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        if f"{pre}mlp.experts.0.gate_proj.weight" in w:
            for m in ("gate", "up", "down"):
                stacked = [w.pop(f"{pre}mlp.experts.{e}.{m}_proj.weight") for e in range(cfg["num_experts"])]
                add(f"blk.{i}.ffn_{m}_exps.weight", np.stack(stacked), Q8)
        if f"{pre}linear_attn.in_proj_qkvz.weight" in w:
            qkvz = w.pop(f"{pre}linear_attn.in_proj_qkvz.weight").T.reshape(-1, nk, 2 * dk + 2 * r * dv)
            q, k, v, z = np.split(qkvz, np.cumsum([dk, dk, r * dv]), axis=-1)
            hidden = qkvz.shape[0]
            qkv = np.concatenate([x.reshape(hidden, -1) for x in (q, k, v)], axis=-1).T
            add(f"blk.{i}.attn_qkv.weight", qkv)
            add(f"blk.{i}.attn_gate.weight", z.reshape(hidden, -1).T)
        if f"{pre}linear_attn.A_log" in w:
            add(f"blk.{i}.ssm_a", -np.exp(w.pop(f"{pre}linear_attn.A_log")))
            add(f"blk.{i}.ssm_conv1d.weight", w.pop(f"{pre}linear_attn.conv1d.weight")[:, 0])
        for key in sorted(k for k in w if k.startswith(pre)):
            part, x = key[len(pre) :], w.pop(key)
            if part.endswith("norm.weight") and not part.startswith("linear_attn."):
                x = x + 1
            if part == "mlp.shared_expert_gate.weight":
                x = x.reshape(-1)
            add(f"blk.{i}.{names[part]}", x)
    assert not w, f"tensors left unwritten: {sorted(w)[:5]}"
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()
    return out


_DELTANET = dict(
    _BASE,
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    head_dim=16,
    shared_expert_intermediate_size=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # two value heads per key head: Qwen3.5's GGUF reorders them
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)


def _norms(name: str, t: torch.Tensor) -> None:
    if name.endswith("norm.weight") and "linear_attn" not in name:  # zeros by default (1 + weight): make them count
        t.copy_(torch.randn_like(t) * 0.2)


def _norms_and_heads(name: str, t: torch.Tensor) -> None:
    _norms(name, t)
    if name.endswith(("A_log", "dt_bias")):  # distinct per head: a head order left wrong shows
        t.copy_(torch.randn_like(t))


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("qwen35_gguf") / "hf"
    save_tiny(transformers.Qwen3_5MoeTextConfig(**_DELTANET), d, _norms_and_heads)
    return d


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("qwen3_next_gguf") / "hf"
    save_tiny(transformers.Qwen3NextConfig(**_DELTANET, intermediate_size=96, mlp_only_layers=[2]), d, _norms)
    return d


@pytest.mark.slow
def test_qwen3next_gguf_converts_to_the_store_of_the_same_q8_0_weights(qwen3_next: Path, tmp_path: Path):
    """llama.cpp's rewrites undone (in_proj_qkvz regrouped back, A_log from -exp(A_log), the norms' 1 taken off):
    the same config, expert bytes and (float32 round trips of exp/log and +1/-1 aside) the same logits."""
    gguf = write_qwen3_next_gguf(qwen3_next, tmp_path / "qwen3next.gguf")
    ours = convert_gguf(gguf, tmp_path / "from-gguf", ConvertOptions.full(bits=None, keep_bf16=False), progress=False)
    ref = reference_store(qwen3_next, tmp_path / "from-safetensors", "q8_0")
    a, b = load_config(ours), load_config(ref)
    assert a.model_type == "qwen3_next" and a.layer_types == b.layer_types
    assert (a.delta, a.conv_kernel, a.dense_layers, a.rope.partial_rotary_factor) == (
        b.delta,
        b.conv_kernel,
        b.dense_layers,
        b.rope.partial_rotary_factor,
    )
    assert (ours / "experts-8.bin").read_bytes() == (ref / "experts-8.bin").read_bytes()
    ids = torch.randint(0, 4096, (1, 10), generator=torch.Generator().manual_seed(7))
    x, y = _logits(ours, ids), _logits(ref, ids)
    assert (x - y).abs().max().item() <= 1e-4
    assert torch.equal(x.argmax(-1), y.argmax(-1))


@pytest.mark.slow
def test_qwen35moe_gguf_converts_to_the_store_of_the_same_q8_0_weights(qwen35: Path, tmp_path: Path):
    """Qwen3.5: the value heads llama.cpp tiled put back in groups by key head, in every DeltaNet tensor."""
    gguf = write_qwen3_next_gguf(qwen35, tmp_path / "qwen35moe.gguf", arch="qwen35moe")
    ours = convert_gguf(gguf, tmp_path / "from-gguf", ConvertOptions.full(bits=None, keep_bf16=False), progress=False)
    ref = reference_store(qwen35, tmp_path / "from-safetensors", "q8_0")
    a, b = load_config(ours), load_config(ref)
    assert a.model_type == "qwen3_5_moe_text" and a.delta == b.delta and a.delta is not None and a.delta.split_proj
    assert a.layer_types == b.layer_types and a.dense_layers == b.dense_layers == ()
    assert (ours / "experts-8.bin").read_bytes() == (ref / "experts-8.bin").read_bytes()
    ids = torch.randint(0, 4096, (1, 10), generator=torch.Generator().manual_seed(7))
    x, y = _logits(ours, ids), _logits(ref, ids)
    assert (x - y).abs().max().item() <= 1e-4
    assert torch.equal(x.argmax(-1), y.argmax(-1))
