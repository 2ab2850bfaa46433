"""LFM2-MoE (``lfm2_moe``, LFM2-8B-A1B): layers that mix tokens with a gated short convolution (``conv``: in_proj
to B, C and x, a depthwise causal convolution of ``conv_L_cache`` over B·x, C times its output, out_proj) and
grouped-query attention layers with per-head q/k norms (``layer_types``); DeepSeek-V3-style sigmoid routing with a
selection-only expert bias, renormalised (+1e-6) and scaled; the first ``num_dense_layers`` layers dense. The
checkpoint's module names are read as the common ones (``format.tensor_names``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fate_edge.errors import ModelFormatError
from fate_edge.model.arch.base import ModelConfig, common_fields, pick

_KINDS = {"full_attention": "attention", "conv": "conv"}


@dataclass
class Lfm2MoeConfig(ModelConfig):
    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> Lfm2MoeConfig:
        d = {**d, "tie_word_embeddings": d.get("tie_word_embeddings", d.get("tie_embedding", True))}
        if not any(k in d for k in ("rope_theta", "rope_parameters", "rope_scaling")):
            d["rope_theta"] = 1000000.0  # transformers' default for this family
        d.setdefault("rms_norm_eps", d.get("norm_eps", 1e-5))
        f = common_fields(d)
        n = f["num_hidden_layers"]
        types = d.get("layer_types")
        if types is None:
            full = set(d.get("full_attn_idxs") or range(n))
            types = ["full_attention" if i in full else "conv" for i in range(n)]
        if len(types) != n or any(t not in _KINDS for t in types):
            raise ModelFormatError(
                f"config.json: layer_types must list {n} of {', '.join(sorted(_KINDS))}, got {types!r}"
            )
        dense = min(pick(d, "num_dense_layers", default=2), n)
        return cls(
            **f,
            intermediate_size=pick(d, "intermediate_size"),
            moe_intermediate_size=pick(d, "moe_intermediate_size"),
            qk_norm="head",
            router="deepseek_v3",  # one group: the top k of sigmoid(logits) + expert_bias
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            topk_norm_eps=1e-6,
            routed_scaling_factor=float(pick(d, "routed_scaling_factor", default=1.0)),
            dense_layers=tuple(range(dense)),
            layer_types=tuple(_KINDS[t] for t in types),
            conv_kernel=int(pick(d, "conv_L_cache", default=3)),
            conv_bias=bool(d.get("conv_bias", False)),
        )
