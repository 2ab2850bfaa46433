"""Mixtral (mistralai/Mixtral-8x7B and relatives): softmax top-k router with renormalisation, no shared expert."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fate_edge.model.arch.base import ModelConfig, common_fields, pick


@dataclass
class MixtralConfig(ModelConfig):
    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> MixtralConfig:
        f = common_fields(d)
        window = d.get("sliding_window")
        return cls(
            **f,
            intermediate_size=pick(d, "intermediate_size"),
            moe_intermediate_size=pick(d, "intermediate_size"),
            norm_topk_prob=True,  # Mixtral always renormalises the selected weights
            sliding_window=window,
            sliding_window_layers=tuple(range(f["num_hidden_layers"])) if window else (),
        )
