"""Tensors of the published checkpoints of gpt-oss, Qwen3-Next and LFM2-MoE, named and shaped as released.

* gpt-oss (float layout, as transformers saves it): ``self_attn.{q,k,v,o}_proj`` with biases and ``sinks``,
  ``mlp.router`` (weight and bias), the experts fused as ``mlp.experts.gate_up_proj`` [E, H, 2I] and
  ``down_proj`` [E, I, H] with their biases (inputs first: ``out_last``).
* Qwen3-Next: ``linear_attn`` (``in_proj_qkvz``, ``in_proj_ba``, ``conv1d``, ``dt_bias``, ``A_log``, gated
  ``norm``, ``out_proj``) or gated ``self_attn`` (q_proj twice as wide: each head's query and its gate) per
  ``layer_types``; per-expert MLPs and a sigmoid-gated shared expert; RMSNorms that scale by ``1 + weight``
  (``offset``), except the DeltaNet's gated norm. The published MTP weights (``mtp.*``) are left out: transformers
  and fate-edge skip them.
* LFM2-MoE: ``conv`` (``in_proj`` [3H, H], depthwise ``conv`` [H, 1, L], ``out_proj``) or ``self_attn`` (``out_proj``,
  ``q_layernorm``/``k_layernorm``) per layer, ``operator_norm``/``ffn_norm``, ``feed_forward`` (w1/w3/w2, the
  router ``gate`` and ``expert_bias``), the final norm as ``model.embedding_norm``; tied embeddings.
"""

from __future__ import annotations

from fate_edge.model.arch import ModelConfig
from fate_edge_lab.synthetic.tensor_spec import TensorSpec, _mlp


def _qkv(p: str, cfg: ModelConfig, i: int, q_rows: int, bias: bool) -> list[TensorSpec]:
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    out = []
    for proj, rows in (("q_proj", q_rows), ("k_proj", kv), ("v_proj", kv)):
        out.append(TensorSpec(f"{p}.{proj}.weight", (rows, h), "proj_in", i))
        if bias:
            out.append(TensorSpec(f"{p}.{proj}.bias", (rows,), "bias", i))
    return out


def gpt_oss_layer(cfg: ModelConfig, i: int) -> list[TensorSpec]:
    h, e, w = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    base, q = f"model.layers.{i}", cfg.num_attention_heads * cfg.head_dim
    p, m = f"{base}.self_attn", f"{base}.mlp"
    return [
        *_qkv(p, cfg, i, q, True),
        TensorSpec(f"{p}.o_proj.weight", (h, q), "attn_out", i),
        TensorSpec(f"{p}.o_proj.bias", (h,), "out_bias", i),
        TensorSpec(f"{p}.sinks", (cfg.num_attention_heads,), "bias", i),
        TensorSpec(f"{base}.input_layernorm.weight", (h,), "norm", i),
        TensorSpec(f"{base}.post_attention_layernorm.weight", (h,), "norm", i),
        TensorSpec(f"{m}.router.weight", (e, h), "router", i),
        TensorSpec(f"{m}.router.bias", (e,), "bias", i),
        TensorSpec(f"{m}.experts.gate_up_proj", (e, h, 2 * w), "proj_in", i, "expert", out_last=True),
        TensorSpec(f"{m}.experts.gate_up_proj_bias", (e, 2 * w), "bias", i),
        TensorSpec(f"{m}.experts.down_proj", (e, w, h), "mlp_out", i, "expert", out_last=True),
        TensorSpec(f"{m}.experts.down_proj_bias", (e, h), "out_bias", i),
    ]


def qwen3_next_layer(cfg: ModelConfig, i: int) -> list[TensorSpec]:
    h, base, one = cfg.hidden_size, f"model.layers.{i}", 1.0
    out: list[TensorSpec] = []
    if cfg.layer_types[i] == "linear_attention":
        d, p = cfg.delta, f"{base}.linear_attn"
        assert d is not None
        key, value = d.key_heads * d.key_dim, d.value_heads * d.value_dim
        out += [
            TensorSpec(f"{p}.conv1d.weight", (2 * key + value, 1, cfg.conv_kernel), "proj_in", i),
            TensorSpec(f"{p}.dt_bias", (d.value_heads,), "bias", i),
            TensorSpec(f"{p}.A_log", (d.value_heads,), "bias", i),
            TensorSpec(f"{p}.in_proj_ba.weight", (2 * d.value_heads, h), "proj_in", i),
            TensorSpec(f"{p}.in_proj_qkvz.weight", (2 * key + 2 * value, h), "proj_in", i),
            TensorSpec(f"{p}.norm.weight", (d.value_dim,), "norm", i),  # weight times x: no offset
            TensorSpec(f"{p}.out_proj.weight", (h, value), "attn_out", i),
        ]
    else:
        p, q = f"{base}.self_attn", cfg.num_attention_heads * cfg.head_dim
        out += [
            *_qkv(p, cfg, i, 2 * q, False),
            TensorSpec(f"{p}.o_proj.weight", (h, q), "attn_out", i),
            TensorSpec(f"{p}.q_norm.weight", (cfg.head_dim,), "norm", i, offset=one),
            TensorSpec(f"{p}.k_norm.weight", (cfg.head_dim,), "norm", i, offset=one),
        ]
    out += [
        TensorSpec(f"{base}.input_layernorm.weight", (h,), "norm", i, offset=one),
        TensorSpec(f"{base}.post_attention_layernorm.weight", (h,), "norm", i, offset=one),
    ]
    m = f"{base}.mlp"
    if not cfg.is_moe_layer(i):
        return out + _mlp(m, h, cfg.intermediate_size, i, "dense")
    out.append(TensorSpec(f"{m}.gate.weight", (cfg.num_experts, h), "router", i))
    for j in range(cfg.num_experts):
        out += _mlp(f"{m}.experts.{j}", h, cfg.moe_intermediate_size, i, "expert")
    out += _mlp(f"{m}.shared_expert", h, cfg.shared_expert_intermediate_size, i, "shared")
    return out + [TensorSpec(f"{m}.shared_expert_gate.weight", (1, h), "shared_gate", i)]


def lfm2_moe_layer(cfg: ModelConfig, i: int) -> list[TensorSpec]:
    h, base = cfg.hidden_size, f"model.layers.{i}"
    out: list[TensorSpec] = []
    if cfg.layer_types[i] == "conv":
        p = f"{base}.conv"
        out += [
            TensorSpec(f"{p}.conv.weight", (h, 1, cfg.conv_kernel), "proj_in", i),
            TensorSpec(f"{p}.in_proj.weight", (3 * h, h), "proj_in", i),
            TensorSpec(f"{p}.out_proj.weight", (h, h), "attn_out", i),
        ]
    else:
        p, q = f"{base}.self_attn", cfg.num_attention_heads * cfg.head_dim
        out += [
            *_qkv(p, cfg, i, q, False),
            TensorSpec(f"{p}.out_proj.weight", (h, q), "attn_out", i),
            TensorSpec(f"{p}.q_layernorm.weight", (cfg.head_dim,), "norm", i),
            TensorSpec(f"{p}.k_layernorm.weight", (cfg.head_dim,), "norm", i),
        ]
    out += [
        TensorSpec(f"{base}.operator_norm.weight", (h,), "norm", i),
        TensorSpec(f"{base}.ffn_norm.weight", (h,), "norm", i),
    ]
    m = f"{base}.feed_forward"
    if not cfg.is_moe_layer(i):
        return out + _mlp(m, h, cfg.intermediate_size, i, "dense", ("w1", "w3", "w2"))
    out += [
        TensorSpec(f"{m}.gate.weight", (cfg.num_experts, h), "router", i),
        TensorSpec(f"{m}.expert_bias", (cfg.num_experts,), "score_bias", i),
    ]
    for j in range(cfg.num_experts):
        out += _mlp(f"{m}.experts.{j}", h, cfg.moe_intermediate_size, i, "expert", ("w1", "w3", "w2"))
    return out


def hybrid_specs(cfg: ModelConfig) -> list[TensorSpec] | None:
    """Every tensor of a gpt-oss / Qwen3-Next / LFM2-MoE checkpoint in order; None for the other families."""
    layer = {"gpt_oss": gpt_oss_layer, "qwen3_next": qwen3_next_layer, "lfm2_moe": lfm2_moe_layer}.get(cfg.model_type)
    if layer is None:
        return None
    h, lfm2 = cfg.hidden_size, cfg.model_type == "lfm2_moe"
    specs = [TensorSpec("model.embed_tokens.weight", (cfg.vocab_size, h), "embed")]
    for i in range(cfg.num_hidden_layers):
        specs += layer(cfg, i)
    offset = 1.0 if cfg.model_type == "qwen3_next" else 0.0
    specs.append(
        TensorSpec("model.embedding_norm.weight" if lfm2 else "model.norm.weight", (h,), "norm", offset=offset)
    )
    if not cfg.tie_word_embeddings:
        specs.append(TensorSpec("lm_head.weight", (cfg.vocab_size, h), "lm_head"))
    return specs
