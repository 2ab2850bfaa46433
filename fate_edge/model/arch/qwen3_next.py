"""Qwen3-Next (``qwen3_next``): gated DeltaNet linear-attention layers (``linear_attn``: a short causal
convolution over q, k and v, the gated delta rule, an output RMSNorm gated by silu(z)) interleaved with gated
full-attention layers (``self_attn``: each head's query followed by its output gate, sigmoid(gate) times the
attention's output; per-head q/k norms; rope over the first quarter of each head); RMSNorms that scale by
``1 + weight``; Qwen2-MoE's softmax routing with a sigmoid-gated shared expert, ``mlp_only_layers`` and
``decoder_sparse_step`` dense.

Qwen3.5 MoE (``qwen3_5_moe``, its text model ``qwen3_5_moe_text``) is the same text model with the DeltaNet's input
projections apart (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``), every layer routed, and, in the
multimodal checkpoint, the text model under ``model.language_model`` (``format.tensor_names``; the vision tower is
not read). Its multimodal rope gives text tokens the plain rope of their position."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fate_edge.errors import ModelFormatError
from fate_edge.model.arch.base import DeltaNetConfig, ModelConfig, RopeConfig, common_fields, pick
from fate_edge.model.arch.qwen2_moe import qwen_dense_layers

_KINDS = {"full_attention": "attention", "linear_attention": "linear_attention"}


@dataclass
class Qwen3NextConfig(ModelConfig):
    split_proj = False  # a class constant, not a field: how this family's checkpoints hold the DeltaNet projections

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> Qwen3NextConfig:
        f = common_fields(d)
        rope_keys = {**(d.get("rope_scaling") or {}), **(d.get("rope_parameters") or {}), **d}
        if "partial_rotary_factor" not in rope_keys:  # transformers' default for this family
            f["rope"] = RopeConfig.from_hf({**d, "partial_rotary_factor": 0.25}, f["max_position_embeddings"])
        n = f["num_hidden_layers"]
        types = d.get("layer_types")
        if types is None:
            every = pick(d, "full_attention_interval", default=4)
            types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
        if len(types) != n or any(t not in _KINDS for t in types):
            raise ModelFormatError(
                f"config.json: layer_types must list {n} of {', '.join(sorted(_KINDS))}, got {types!r}"
            )
        delta = DeltaNetConfig(
            key_heads=pick(d, "linear_num_key_heads", default=16),
            value_heads=pick(d, "linear_num_value_heads", default=32),
            key_dim=pick(d, "linear_key_head_dim", default=128),
            value_dim=pick(d, "linear_value_head_dim", default=128),
            split_proj=cls.split_proj,
        )
        if delta.value_heads % delta.key_heads:
            raise ModelFormatError(
                f"config.json: linear_num_value_heads ({delta.value_heads}) is not a multiple of "
                f"linear_num_key_heads ({delta.key_heads}); the config is damaged"
            )
        return cls(
            **f,
            intermediate_size=pick(d, "intermediate_size", default=0),  # Qwen3.5 routes every layer
            moe_intermediate_size=pick(d, "moe_intermediate_size"),
            attention_bias=bool(d.get("attention_bias", False)),
            o_proj_bias=bool(d.get("attention_bias", False)),
            qk_norm="head",
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            shared_expert_intermediate_size=pick(d, "shared_expert_intermediate_size", default=0),
            shared_expert_gated=True,
            dense_layers=qwen_dense_layers(d, n),
            layer_types=tuple(_KINDS[t] for t in types),
            conv_kernel=int(pick(d, "linear_conv_kernel_dim", default=4)),
            attn_output_gate=True,
            norm_offset=1.0,
            delta=delta,
        )


@dataclass
class Qwen35MoeConfig(Qwen3NextConfig):
    split_proj = True
