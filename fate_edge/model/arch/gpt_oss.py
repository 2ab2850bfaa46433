"""gpt-oss (``gpt_oss``; 20b, 120b): grouped-query attention with biases on q/k/v/o and a learned sink logit per
head in every softmax's denominator (``self_attn.sinks``); sliding-window layers alternating with full ones
(``layer_types``); YaRN rope; a router with a bias whose top-k logits are softmaxed (``mlp.router``); routed experts
with biases on both matmuls and a clamped SwiGLU (``swiglu_limit``, ``swiglu_alpha``), stored as
``mlp.experts.gate_up_proj`` [E, H, 2I] with gate and up in alternating columns and ``down_proj`` [E, I, H]. Every
layer is routed; no shared expert."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fate_edge.model.arch.base import ModelConfig, common_fields, pick
from fate_edge.model.arch.limits import check_layer_types, positive_number

# transformers' defaults where a config leaves rope out (GptOssConfig.__post_init__)
DEFAULT_ROPE = dict(
    rope_type="yarn",
    rope_theta=150000.0,
    factor=32.0,
    beta_fast=32.0,
    beta_slow=1.0,
    truncate=False,
    original_max_position_embeddings=4096,
)


@dataclass
class GptOssConfig(ModelConfig):
    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> GptOssConfig:
        if not any(k in d for k in ("rope_parameters", "rope_scaling")):
            d = {**d, "rope_parameters": {**DEFAULT_ROPE, "rope_theta": d.get("rope_theta", 150000.0)}}
        d = {**d, "head_dim": d.get("head_dim") or 64, "rms_norm_eps": d.get("rms_norm_eps") or 1e-5}
        f = common_fields(d)
        n = f["num_hidden_layers"]
        types = d.get("layer_types")
        if types is None:  # transformers' default: sliding first, then alternating
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
        check_layer_types(types, n, "config.json", ("sliding_attention", "full_attention"))
        window = pick(d, "sliding_window", default=128)
        sliding = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
        bias = bool(d.get("attention_bias", True))
        inter = pick(d, "intermediate_size")
        return cls(
            **f,
            intermediate_size=inter,
            moe_intermediate_size=inter,  # every MLP is routed: one width
            attention_bias=bias,
            o_proj_bias=bias,
            sliding_window=window if sliding and window else None,
            sliding_window_layers=sliding if window else (),
            attention_sinks=True,
            router="topk_softmax",
            expert_bias=True,
            swiglu_limit=positive_number(d.get("swiglu_limit", 7.0), "config.json: 'swiglu_limit'"),
            swiglu_alpha=positive_number(d.get("swiglu_alpha", 1.702), "config.json: 'swiglu_alpha'"),
            experts_interleaved=True,
        )
