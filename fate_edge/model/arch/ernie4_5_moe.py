"""ERNIE-4.5 MoE (``ernie4_5_moe``): grouped-query attention with rope on adjacent pairs, computed in float32; a
softmax router whose choice adds a selection-only bias (``mlp.moe_statics.e_score_correction_bias``) and whose
weights are the chosen probabilities renormalised; ungated shared experts; MoE layers every
``moe_layer_interval`` layers from ``moe_layer_start_index`` to ``moe_layer_end_index``, the others dense."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fate_edge.errors import UnsupportedArchitectureError
from fate_edge.model.arch.base import ModelConfig, RopeConfig, common_fields, pick


@dataclass
class Ernie45MoeConfig(ModelConfig):
    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> Ernie45MoeConfig:
        if d.get("use_bias"):
            raise UnsupportedArchitectureError(
                "config.json: ERNIE-4.5 with use_bias (biases on every linear, experts included) is not supported; "
                "the released ERNIE-4.5 MoE checkpoints have none"
            )
        d = {**d, "tie_word_embeddings": d.get("tie_word_embeddings", True)}
        if not any(k in d for k in ("rope_theta", "rope_parameters", "rope_scaling")):
            d["rope_theta"] = 500000.0  # transformers' default for this family
        f = common_fields(d)
        f["rope"] = RopeConfig.from_hf(d, f["max_position_embeddings"])
        f["rope"].interleaved = True  # rotate_half over (x0, x1), (x2, x3), ... with interleaved cos/sin
        f["rope"].float32 = True
        n = f["num_hidden_layers"]
        start = pick(d, "moe_layer_start_index", default=1)
        end = pick(d, "moe_layer_end_index", default=-1)
        end = n - 1 if end == -1 else end
        step = pick(d, "moe_layer_interval", default=1)
        moe = {i for i in range(n) if (i + 1) % step == 0 and start <= i <= end}
        return cls(
            **f,
            intermediate_size=pick(d, "intermediate_size"),
            moe_intermediate_size=pick(d, "moe_intermediate_size"),
            router="softmax",  # with the selection bias the loader finds (route() applies it when present)
            norm_topk_prob=True,
            shared_expert_intermediate_size=pick(d, "moe_intermediate_size")
            * pick(d, "moe_num_shared_experts", default=0),
            dense_layers=tuple(i for i in range(n) if i not in moe),
        )
