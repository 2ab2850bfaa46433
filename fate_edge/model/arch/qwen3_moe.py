"""Qwen3-MoE: per-head q/k RMSNorm, explicit head_dim, no shared expert."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fate_edge.model.arch.base import ModelConfig, common_fields, pick
from fate_edge.model.arch.qwen2_moe import qwen_dense_layers, qwen_sliding_layers


@dataclass
class Qwen3MoeConfig(ModelConfig):
    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> Qwen3MoeConfig:
        f = common_fields(d)
        n = f["num_hidden_layers"]
        sliding = qwen_sliding_layers(d, n)
        return cls(
            **f,
            intermediate_size=pick(d, "intermediate_size"),
            moe_intermediate_size=pick(d, "moe_intermediate_size"),
            attention_bias=bool(d.get("attention_bias", False)),
            o_proj_bias=bool(d.get("attention_bias", False)),
            qk_norm="head",
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            dense_layers=qwen_dense_layers(d, n),
            sliding_window=d.get("sliding_window") if sliding else None,
            sliding_window_layers=sliding,
        )
