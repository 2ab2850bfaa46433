"""OLMoE (allenai/OLMoE-1B-7B): q/k RMSNorm over the full projection width, optional q/k/v clipping."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fate_edge.model.arch.base import ModelConfig, common_fields, pick


@dataclass
class OlmoeConfig(ModelConfig):
    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> OlmoeConfig:
        f = common_fields(d)
        bias = bool(d.get("attention_bias", False))
        return cls(
            **f,
            intermediate_size=pick(d, "intermediate_size"),
            moe_intermediate_size=pick(d, "intermediate_size"),
            attention_bias=bias,
            o_proj_bias=bias,
            qk_norm="full",
            clip_qkv=d.get("clip_qkv"),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        )
