"""DeepSeek-V2 / V2-Lite and DeepSeek-V3 style models: MLA attention, shared experts, dense first layers.

V2 routes with a softmax (greedy or group-limited top-k); V3 with sigmoid scores, an
``e_score_correction_bias`` used for selection only, group-limited top-k by the sum of each group's
two best scores, and optional renormalisation. Both scale routed outputs by ``routed_scaling_factor``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fate_edge.model.arch.base import MLAConfig, ModelConfig, common_fields, pick


def _deepseek_fields(d: dict[str, Any]) -> dict[str, Any]:
    f = common_fields(d)
    mla = MLAConfig(
        q_lora_rank=d.get("q_lora_rank"),
        kv_lora_rank=pick(d, "kv_lora_rank"),
        qk_nope_head_dim=pick(d, "qk_nope_head_dim"),
        qk_rope_head_dim=pick(d, "qk_rope_head_dim"),
        v_head_dim=pick(d, "v_head_dim"),
    )
    f["head_dim"] = mla.qk_rope_head_dim  # the rope runs over this part only
    f["rope"].interleaved = bool(d.get("rope_interleave", True))
    first_dense = pick(d, "first_k_dense_replace", default=0)
    moe_freq = pick(d, "moe_layer_freq", default=1)
    n = f["num_hidden_layers"]
    bias = bool(d.get("attention_bias", False))
    return dict(
        **f,
        intermediate_size=pick(d, "intermediate_size"),
        moe_intermediate_size=pick(d, "moe_intermediate_size"),
        attention_bias=bias,
        o_proj_bias=bias,
        mla=mla,
        routed_scaling_factor=float(pick(d, "routed_scaling_factor", default=1.0)),
        n_group=pick(d, "n_group", default=1),
        topk_group=pick(d, "topk_group", default=1),
        shared_expert_intermediate_size=pick(d, "moe_intermediate_size") * pick(d, "n_shared_experts", default=0),
        dense_layers=tuple(i for i in range(n) if i < first_dense or i % moe_freq != 0),
    )


@dataclass
class DeepseekV2Config(ModelConfig):
    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> DeepseekV2Config:
        f = _deepseek_fields(d)
        f["rope"].interleaved = True  # V2 always rotates adjacent pairs
        f["rope"].float32 = True  # ... as complex numbers in float32, cast back to the model dtype afterwards
        return cls(**f, router="deepseek_v2", topk_method=d.get("topk_method") or "greedy", norm_topk_prob=False)


@dataclass
class DeepseekV3Config(ModelConfig):
    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> DeepseekV3Config:
        return cls(**_deepseek_fields(d), router="deepseek_v3", norm_topk_prob=bool(d.get("norm_topk_prob", True)))
