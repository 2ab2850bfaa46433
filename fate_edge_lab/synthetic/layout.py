"""Which tensors a checkpoint of a given config holds, named and shaped as the published checkpoints are.

The names are the published ones: ``model.layers.{i}.mlp.experts.{j}.gate_proj/up_proj/down_proj`` (Qwen,
OLMoE, DeepSeek, GLM-4.5, ERNIE-4.5), ``model.layers.{i}.block_sparse_moe.experts.{j}.w1/w3/w2`` (Mixtral,
MiniMax-M2), ``mlp.shared_expert`` + ``mlp.shared_expert_gate`` (Qwen1.5-MoE), ``mlp.shared_experts`` (DeepSeek,
GLM-4.5, ERNIE-4.5); GLM-4.5's MTP layers past ``num_hidden_layers`` as published (the runtime does not read
them). Shapes come from fate-edge's own config parser (``fate_edge.model.arch``), so the generator and the runtime
read one config the same way.
"""

from __future__ import annotations

from typing import Any

from fate_edge.errors import SyntheticSpecError
from fate_edge.model.arch import ModelConfig, config_from_dict
from fate_edge_lab.synthetic.layout_hybrid import hybrid_specs
from fate_edge_lab.synthetic.tensor_spec import TensorSpec, _mlp

__all__ = ["SCALED_KEYS", "SCORE_BIAS", "TensorSpec", "shape_config", "tensor_specs"]

# Keys divided by --scale (everything that is a width); counts (layers, heads, experts, top-k) and vocab stay.
SCALED_KEYS = (
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "head_dim",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "rotary_dim",  # MiniMax-M2's rotary width
    "linear_key_head_dim",  # Qwen3-Next's DeltaNet heads
    "linear_value_head_dim",
)
# The MoE block's selection-only correction bias, where the published checkpoint holds one: name under the block
# and shape (GLM-4.5 in the router, MiniMax-M2 in the block, ERNIE-4.5 in the block's ``moe_statics`` as [1, E]).
SCORE_BIAS = {
    "glm4_moe": ("gate.e_score_correction_bias", False),
    "minimax_m2": ("e_score_correction_bias", False),
    "ernie4_5_moe": ("moe_statics.e_score_correction_bias", True),
}


def shape_config(config: dict[str, Any], scale: int = 1, layers: int | None = None) -> dict[str, Any]:
    """The published ``config`` with widths divided by ``scale`` and ``num_hidden_layers`` trimmed to ``layers``."""
    out = dict(config)
    if scale < 1:
        raise SyntheticSpecError(f"--scale must be a positive integer divisor, not {scale}")
    if "head_dim" not in out and "kv_lora_rank" not in out:  # MLA has no single head width
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]  # made explicit so it scales too
        implicit_head_dim = True
    else:
        implicit_head_dim = False
    for key in SCALED_KEYS:
        value = out.get(key)
        if value is None:
            continue
        if value % scale:
            raise SyntheticSpecError(f"--scale {scale} does not divide {key}={value}; pick a divisor of it (e.g. 16)")
        out[key] = value // scale
    if implicit_head_dim:
        if out["head_dim"] * out["num_attention_heads"] != out["hidden_size"]:
            raise SyntheticSpecError(f"--scale {scale}: head width no longer matches hidden_size / heads")
        del out["head_dim"]  # keep the published key set
    for key in ("qk_rope_head_dim", "head_dim"):
        if out.get(key) is not None and out[key] % 2:
            raise SyntheticSpecError(
                f"--scale {scale} makes {key}={out[key]} odd; rotary needs pairs: pick a smaller scale"
            )
    if layers is not None:
        if not 1 <= layers <= config["num_hidden_layers"]:
            raise SyntheticSpecError(f"--layers must be in 1..{config['num_hidden_layers']}, not {layers}")
        out["num_hidden_layers"] = layers
        if isinstance(out.get("layer_types"), list):  # one entry per layer (gpt-oss, LFM2-MoE)
            out["layer_types"] = out["layer_types"][:layers]
    return out


def _attention(cfg: ModelConfig, p: str, i: int) -> list[TensorSpec]:
    h, out = cfg.hidden_size, []
    if cfg.mla is not None:
        m = cfg.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank is None:
            out.append(TensorSpec(f"{p}.q_proj.weight", (cfg.num_attention_heads * qk, h), "proj_in", i))
        else:
            out += [
                TensorSpec(f"{p}.q_a_proj.weight", (m.q_lora_rank, h), "proj_in", i),
                TensorSpec(f"{p}.q_a_layernorm.weight", (m.q_lora_rank,), "norm", i),
                TensorSpec(f"{p}.q_b_proj.weight", (cfg.num_attention_heads * qk, m.q_lora_rank), "proj_in", i),
            ]
        out += [
            TensorSpec(f"{p}.kv_a_proj_with_mqa.weight", (m.kv_lora_rank + m.qk_rope_head_dim, h), "proj_in", i),
            TensorSpec(f"{p}.kv_a_layernorm.weight", (m.kv_lora_rank,), "norm", i),
            TensorSpec(
                f"{p}.kv_b_proj.weight",
                (cfg.num_attention_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
                "proj_in",
                i,
            ),
            TensorSpec(f"{p}.o_proj.weight", (h, cfg.num_attention_heads * m.v_head_dim), "attn_out", i),
        ]
        return out
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        out.append(TensorSpec(f"{p}.{proj}.weight", (rows, h), "proj_in", i))
        if cfg.attention_bias:
            out.append(TensorSpec(f"{p}.{proj}.bias", (rows,), "bias", i))
    out.append(TensorSpec(f"{p}.o_proj.weight", (h, q), "attn_out", i))
    if cfg.o_proj_bias:
        out.append(TensorSpec(f"{p}.o_proj.bias", (h,), "bias", i))
    if cfg.qk_norm == "full":  # OLMoE: over all heads
        out += [TensorSpec(f"{p}.q_norm.weight", (q,), "norm", i), TensorSpec(f"{p}.k_norm.weight", (kv,), "norm", i)]
    elif cfg.qk_norm == "head":  # Qwen3: per head
        out += [
            TensorSpec(f"{p}.q_norm.weight", (cfg.head_dim,), "norm", i),
            TensorSpec(f"{p}.k_norm.weight", (cfg.head_dim,), "norm", i),
        ]
    return out


def tensor_specs(config: dict[str, Any]) -> list[TensorSpec]:
    """Every tensor of a checkpoint for ``config`` (a config.json dict), in checkpoint order (by layer)."""
    cfg = config_from_dict(dict(config))
    hybrid = hybrid_specs(cfg)
    if hybrid is not None:
        return hybrid
    h = cfg.hidden_size
    mixtral = cfg.model_type in ("mixtral", "minimax_m2")
    specs = [TensorSpec("model.embed_tokens.weight", (cfg.vocab_size, h), "embed")]
    mtp = int(config.get("num_nextn_predict_layers") or 0) if cfg.model_type == "glm4_moe" else 0
    for i in range(cfg.num_hidden_layers + mtp):
        base = f"model.layers.{i}"
        if i >= cfg.num_hidden_layers:  # GLM's MTP layer: a MoE decoder layer and its own projections
            specs += [
                TensorSpec(f"{base}.eh_proj.weight", (h, 2 * h), "proj_in", i),
                TensorSpec(f"{base}.enorm.weight", (h,), "norm", i),
                TensorSpec(f"{base}.hnorm.weight", (h,), "norm", i),
                TensorSpec(f"{base}.shared_head.norm.weight", (h,), "norm", i),
            ]
        specs += _attention(cfg, f"{base}.self_attn", i)
        specs += [
            TensorSpec(f"{base}.input_layernorm.weight", (h,), "norm", i),
            TensorSpec(f"{base}.post_attention_layernorm.weight", (h,), "norm", i),
        ]
        mlp = f"{base}.block_sparse_moe" if mixtral else f"{base}.mlp"
        if i < cfg.num_hidden_layers and not cfg.is_moe_layer(i):
            specs += _mlp(mlp, h, cfg.intermediate_size, i, "dense")
            continue
        specs.append(TensorSpec(f"{mlp}.gate.weight", (cfg.num_experts, h), "router", i))
        if cfg.model_type in SCORE_BIAS:
            name, row = SCORE_BIAS[cfg.model_type]
            shape = (1, cfg.num_experts) if row else (cfg.num_experts,)
            specs.append(TensorSpec(f"{mlp}.{name}", shape, "score_bias", i))
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        for j in range(cfg.num_experts):
            specs += _mlp(f"{mlp}.experts.{j}", h, cfg.moe_intermediate_size, i, "expert", names)
        if cfg.shared_expert_intermediate_size:
            shared = f"{mlp}.shared_expert" if cfg.shared_expert_gated else f"{mlp}.shared_experts"
            specs += _mlp(shared, h, cfg.shared_expert_intermediate_size, i, "shared")
            if cfg.shared_expert_gated:
                specs.append(TensorSpec(f"{mlp}.shared_expert_gate.weight", (1, h), "shared_gate", i))
    specs.append(TensorSpec("model.norm.weight", (h,), "norm"))
    if not cfg.tie_word_embeddings:
        specs.append(TensorSpec("lm_head.weight", (cfg.vocab_size, h), "lm_head"))
    return specs
