"""GGUF files written by the ``gguf`` package (llama.cpp's own writer) from a Hugging Face checkpoint, for tests
that need no llama.cpp: the metadata and tensor names llama.cpp's converter writes for the architecture, the
routed experts stacked per layer, each tensor in the type asked (gguf-py's quantizers: q4_0, q8_0, ...)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, quants
from safetensors.torch import load_file

ARCH = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
for _p, _g in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output")):
    for _kind in ("weight", "bias"):
        _LAYER[f"self_attn.{_p}_proj.{_kind}"] = f"attn_{_g}.{_kind}"
for _m in ("gate", "up", "down"):
    _LAYER[f"mlp.shared_expert.{_m}_proj.weight"] = f"ffn_{_m}_shexp.weight"
    _LAYER[f"mlp.{_m}_proj.weight"] = f"ffn_{_m}.weight"
_LAYER["self_attn.q_norm.weight"] = "attn_q_norm.weight"
_LAYER["self_attn.k_norm.weight"] = "attn_k_norm.weight"


def q4_k_blocks(x: np.ndarray) -> np.ndarray:
    """``x`` [..., K] (K a multiple of 256) as q4_K blocks [..., K / 256 * 144] by a plain min/max rounding (gguf-py has
    no q4_K quantizer; llama.cpp's searches its scales, but any valid blocks do here): per 32 weights a 6-bit scale
    and min under the super-block's fp16 ``d`` and ``dmin``, ``w = d sc q - dmin m``."""
    sub = x.astype(np.float32).reshape(-1, 8, 32)
    n = sub.shape[0]
    mins = -np.minimum(sub.min(-1), 0)  # ggml's mins are subtracted: m >= 0
    scales = (sub.max(-1) + mins) / 15
    d, dmin = (scales.max(-1) / 63).astype(np.float16), (mins.max(-1) / 63).astype(np.float16)
    df, dmf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(scales / np.where(df > 0, df, 1)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(mins / np.where(dmf > 0, dmf, 1)), 0, 63).astype(np.uint8)
    s, z = df * sc, dmf * m
    q = np.clip(np.round((sub + z[..., None]) / np.where(s > 0, s, 1)[..., None]), 0, 15).astype(np.uint8)
    packed_scales = np.concatenate(  # ggml's get_scale_min_k4, inverted
        [sc[:, :4] | (sc[:, 4:] >> 4) << 6, m[:, :4] | (m[:, 4:] >> 4) << 6, (sc[:, 4:] & 0xF) | (m[:, 4:] & 0xF) << 4],
        axis=1,
    )
    pairs = q.reshape(n, 4, 2, 32)  # per 64 weights: the first 32 in the low nibbles, the next 32 in the high
    qs = (pairs[:, :, 0] | pairs[:, :, 1] << 4).reshape(n, 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), packed_scales, qs], 1)
    return blocks.reshape(*x.shape[:-1], x.shape[-1] // 256 * 144)


def _quantize(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype == GGMLQuantizationType.F32:
        return x.astype(np.float32)
    if qtype == GGMLQuantizationType.F16:
        return x.astype(np.float16)
    if qtype == GGMLQuantizationType.Q4_K:
        return q4_k_blocks(x)
    return quants.quantize(x.astype(np.float32), qtype)


def write_gguf(
    model_dir: Path, out: Path, experts: str = "Q4_0", resident: str = "F32", output: str | None = None
) -> Path:
    """``model_dir`` (a qwen2_moe/qwen3_moe/olmoe checkpoint) as the GGUF ``out``: routed experts in ``experts``,
    2-D resident matrices in ``resident`` (routers and norms stay F32, as llama.cpp's converter keeps them), the
    output matrix in ``output`` (default: ``resident``)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = ARCH[cfg["model_type"]]
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tcfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    w = load_file(str(model_dir / "model.safetensors"))
    w = {k: v.float().numpy() for k, v in w.items()}
    e_type, r_type = GGMLQuantizationType[experts], GGMLQuantizationType[resident]

    g = GGUFWriter(str(out), arch)
    g.add_block_count(cfg["num_hidden_layers"])
    g.add_context_length(cfg.get("max_position_embeddings", 4096))
    g.add_embedding_length(cfg["hidden_size"])
    g.add_feed_forward_length(cfg["intermediate_size"])
    g.add_head_count(cfg["num_attention_heads"])
    g.add_head_count_kv(cfg["num_key_value_heads"])
    theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    g.add_rope_freq_base(theta)
    g.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    g.add_expert_count(cfg["num_experts"])
    g.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("moe_intermediate_size"):
        g.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        g.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if "head_dim" in cfg:
        g.add_key_length(cfg["head_dim"])
        g.add_value_length(cfg["head_dim"])
    # tokenizer: byte-level BPE with GPT-2's split (what our tokenizers use)
    vocab = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["id"] for a in tok["added_tokens"] if a.get("special")}
    g.add_tokenizer_model("gpt2")
    g.add_tokenizer_pre("gpt-2")
    g.add_token_list(tokens)
    g.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    merges = tok["model"]["merges"]
    g.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    eos = vocab.get(tcfg.get("eos_token")) if isinstance(tcfg.get("eos_token"), str) else cfg.get("eos_token_id")
    if eos is not None:
        g.add_eos_token_id(eos)
    g.add_add_bos_token(False)
    template = tcfg.get("chat_template") or (
        (model_dir / "chat_template.jinja").read_text() if (model_dir / "chat_template.jinja").exists() else None
    )
    if template:
        g.add_chat_template(template)

    def add(name: str, x: np.ndarray, qtype: GGMLQuantizationType) -> None:
        if x.ndim < 2 or x.shape[-1] % (256 if qtype == GGMLQuantizationType.Q4_K else 32):
            qtype = GGMLQuantizationType.F32
        data = _quantize(x, qtype)
        g.add_tensor(
            name, data, raw_dtype=qtype if qtype not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) else None
        )

    add("token_embd.weight", w.pop("model.embed_tokens.weight"), r_type)
    add("output_norm.weight", w.pop("model.norm.weight"), GGMLQuantizationType.F32)
    if "lm_head.weight" in w:
        add("output.weight", w.pop("lm_head.weight"), GGMLQuantizationType[output] if output else r_type)
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        for m in ("gate", "up", "down"):
            stacked = np.stack([w.pop(f"{pre}mlp.experts.{e}.{m}_proj.weight") for e in range(cfg["num_experts"])])
            add(f"blk.{i}.ffn_{m}_exps.weight", stacked, e_type)
        for key in sorted(k for k in w if k.startswith(pre)):
            part = key[len(pre) :]
            x = w.pop(key)
            if part == "mlp.shared_expert_gate.weight":
                x = x.reshape(-1)
            keep = part.endswith(("norm.weight", ".bias")) or part == "mlp.gate.weight"
            add(f"blk.{i}.{_LAYER[part]}", x, GGMLQuantizationType.F32 if keep else r_type)
    assert not w, f"tensors left unwritten: {sorted(w)[:5]}"
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()
    return out
