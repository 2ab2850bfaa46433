"""MiniMax-M2 (``minimax_m2``): grouped-query attention with q/k RMSNorm over all heads at once and rope over part
of each head (``partial_rotary_factor``, or the released config's ``rotary_dim``); sigmoid routing with a
selection-only correction bias (the MoE block's ``e_score_correction_bias``), top-k weights renormalised; no shared
expert. Experts are Mixtral's ``w1/w3/w2`` under ``block_sparse_moe`` in the original checkpoints."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fate_edge.model.arch.base import ModelConfig, RopeConfig, common_fields, pick


@dataclass
class MiniMaxM2Config(ModelConfig):
    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> MiniMaxM2Config:
        f = common_fields(d)
        rope_keys = {**(d.get("rope_scaling") or {}), **(d.get("rope_parameters") or {}), **d}
        if d.get("rotary_dim") is not None and "partial_rotary_factor" not in rope_keys:
            # the released config.json says rope width as ``rotary_dim`` (64 of 128); transformers derives the factor
            factor = pick(d, "rotary_dim") / f["head_dim"]
            f["rope"] = RopeConfig.from_hf({**d, "partial_rotary_factor": factor}, f["max_position_embeddings"])
        return cls(
            **f,
            intermediate_size=pick(d, "intermediate_size"),
            moe_intermediate_size=pick(d, "intermediate_size"),  # every MLP is routed: one width
            qk_norm="full",
            router="deepseek_v3",  # sigmoid + correction bias in one group, as MiniMaxM2TopKRouter
            norm_topk_prob=True,
            routed_scaling_factor=float(pick(d, "routed_scaling_factor", default=1.0)),
        )
