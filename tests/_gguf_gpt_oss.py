"""A gpt-oss checkpoint (transformers' float layout) written as the GGUF llama.cpp's converter
(``conversion/gpt_oss.py``, its non-MXFP4 path) makes of it: architecture ``gpt-oss``, ``attn_sinks``,
``post_attention_norm``, the router as ``ffn_gate_inp`` with its bias, ``gate_up_proj`` [E, H, 2I] split into
``ffn_gate_exps``/``ffn_up_exps`` [E, I, H] by its alternating columns (the bias likewise), ``down_proj`` transposed,
YaRN and the sliding window in the metadata."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType
from gguf import quants as gguf_quants
from safetensors.torch import load_file

_ATTN = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}


def write_gpt_oss_gguf(model_dir: Path, out: Path, experts: str = "F32") -> Path:
    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    w = {k: v.float().numpy() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    e_type = GGMLQuantizationType[experts]
    g = GGUFWriter(str(out), "gpt-oss")
    g.add_block_count(cfg["num_hidden_layers"])
    g.add_context_length(cfg["max_position_embeddings"])
    g.add_embedding_length(cfg["hidden_size"])
    g.add_feed_forward_length(cfg["intermediate_size"])
    g.add_head_count(cfg["num_attention_heads"])
    g.add_head_count_kv(cfg["num_key_value_heads"])
    g.add_key_length(cfg["head_dim"])
    g.add_value_length(cfg["head_dim"])
    rope = cfg["rope_parameters"]
    g.add_rope_freq_base(rope["rope_theta"])
    g.add_rope_scaling_type(RopeScalingType.YARN)
    g.add_rope_scaling_factor(rope["factor"])
    g.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    g.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    g.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    g.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    g.add_expert_count(cfg["num_local_experts"])
    g.add_expert_used_count(cfg["num_experts_per_tok"])
    g.add_sliding_window(cfg["sliding_window"])
    g.add_expert_feed_forward_length(cfg["intermediate_size"])
    vocab = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    g.add_tokenizer_model("gpt2")
    g.add_tokenizer_pre("gpt-2")
    g.add_token_list(tokens)
    g.add_token_types([1] * len(tokens))
    g.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    g.add_add_bos_token(False)

    def add(name: str, x: np.ndarray, qtype: GGMLQuantizationType = GGMLQuantizationType.F32) -> None:
        x = np.ascontiguousarray(x, dtype=np.float32)
        if qtype == GGMLQuantizationType.F32:
            g.add_tensor(name, x)
        else:
            g.add_tensor(name, gguf_quants.quantize(x, qtype), raw_dtype=qtype)

    add("token_embd.weight", w.pop("model.embed_tokens.weight"))
    add("output_norm.weight", w.pop("model.norm.weight"))
    add("output.weight", w.pop("lm_head.weight"))
    for i in range(cfg["num_hidden_layers"]):
        pre, blk = f"model.layers.{i}.", f"blk.{i}."
        add(blk + "attn_norm.weight", w.pop(pre + "input_layernorm.weight"))
        add(blk + "post_attention_norm.weight", w.pop(pre + "post_attention_layernorm.weight"))
        for hf, ours in _ATTN.items():
            for kind in ("weight", "bias"):
                add(f"{blk}{ours}.{kind}", w.pop(f"{pre}self_attn.{hf}.{kind}"))
        add(blk + "attn_sinks.weight", w.pop(pre + "self_attn.sinks"))
        add(blk + "ffn_gate_inp.weight", w.pop(pre + "mlp.router.weight"))
        add(blk + "ffn_gate_inp.bias", w.pop(pre + "mlp.router.bias"))
        gate_up = w.pop(pre + "mlp.experts.gate_up_proj").transpose(0, 2, 1)  # [E, 2I, H], gate and up alternating
        bias = w.pop(pre + "mlp.experts.gate_up_proj_bias")
        add(blk + "ffn_gate_exps.weight", gate_up[:, ::2], e_type)
        add(blk + "ffn_up_exps.weight", gate_up[:, 1::2], e_type)
        add(blk + "ffn_gate_exps.bias", bias[:, ::2])
        add(blk + "ffn_up_exps.bias", bias[:, 1::2])
        add(blk + "ffn_down_exps.weight", w.pop(pre + "mlp.experts.down_proj").transpose(0, 2, 1), e_type)
        add(blk + "ffn_down_exps.bias", w.pop(pre + "mlp.experts.down_proj_bias"))
    assert not w, f"tensors left unwritten: {sorted(w)[:5]}"
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()
    return out
