"""GLM-4.5 / 4.6 / 4.5-Air (``glm4_moe``): grouped-query attention with q/k/v biases, optional per-head q/k norms
and rope over the first half of each head (``partial_rotary_factor`` 0.5 by default); DeepSeek-V3's MoE: sigmoid
scores, a selection-only correction bias, group-limited top-k, renormalised and scaled weights, ungated shared
experts; the first ``first_k_dense_replace`` layers dense. Checkpoints carry extra MTP layers past
``num_hidden_layers``, which are not read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fate_edge.model.arch.base import ModelConfig, RopeConfig, common_fields, pick


@dataclass
class Glm4MoeConfig(ModelConfig):
    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> Glm4MoeConfig:
        f = common_fields(d)
        rope_keys = {**(d.get("rope_scaling") or {}), **(d.get("rope_parameters") or {}), **d}
        if "partial_rotary_factor" not in rope_keys:  # transformers' default for this family
            f["rope"] = RopeConfig.from_hf({**d, "partial_rotary_factor": 0.5}, f["max_position_embeddings"])
        first_dense = pick(d, "first_k_dense_replace", default=1)
        bias = bool(d.get("attention_bias", False))
        return cls(
            **f,
            intermediate_size=pick(d, "intermediate_size"),
            moe_intermediate_size=pick(d, "moe_intermediate_size"),
            attention_bias=bias,
            o_proj_bias=False,
            qk_norm="head" if d.get("use_qk_norm") else "none",
            router="deepseek_v3",
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            routed_scaling_factor=float(pick(d, "routed_scaling_factor", default=1.0)),
            n_group=pick(d, "n_group", default=1),
            topk_group=pick(d, "topk_group", default=1),
            shared_expert_intermediate_size=pick(d, "moe_intermediate_size") * pick(d, "n_shared_experts", default=0),
            dense_layers=tuple(range(min(first_dense, f["num_hidden_layers"]))),
        )
