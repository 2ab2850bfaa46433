"""Qwen1.5-MoE / Qwen2-MoE: q/k/v biases, a sigmoid-gated shared expert, optional dense layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fate_edge.model.arch.base import ModelConfig, common_fields, pick


def qwen_dense_layers(d: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """Layers with a dense MLP: listed in mlp_only_layers, or skipped by decoder_sparse_step."""
    only = set(d.get("mlp_only_layers") or [])
    step = d.get("decoder_sparse_step", 1) or 1
    n_exp = pick(d, "num_experts", "num_local_experts", default=0)
    return tuple(i for i in range(num_layers) if i in only or n_exp == 0 or (i + 1) % step != 0)


def qwen_sliding_layers(d: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    if not d.get("use_sliding_window") or not d.get("sliding_window"):
        return ()
    start = d.get("max_window_layers", num_layers)
    return tuple(i for i in range(num_layers) if i >= start)


@dataclass
class Qwen2MoeConfig(ModelConfig):
    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> Qwen2MoeConfig:
        f = common_fields(d)
        n = f["num_hidden_layers"]
        sliding = qwen_sliding_layers(d, n)
        return cls(
            **f,
            intermediate_size=pick(d, "intermediate_size"),
            moe_intermediate_size=pick(d, "moe_intermediate_size"),
            attention_bias=bool(d.get("qkv_bias", True)),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=pick(d, "shared_expert_intermediate_size", default=0),
            shared_expert_gated=True,
            dense_layers=qwen_dense_layers(d, n),
            sliding_window=d.get("sliding_window") if sliding else None,
            sliding_window_layers=sliding,
        )
