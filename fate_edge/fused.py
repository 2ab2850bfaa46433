"""Per-layer weights the forward pass reads, fused into fewer and larger matmuls.

q/k/v become one matrix, a dense MLP's (or shared expert's) gate and up one matrix (with Qwen's shared-expert
gate as its last row). Fusing concatenates once; the checkpoint names in ``Weights`` then point at views into
the fused tensor, so memory does not grow and ``model.w[name]`` still reads the checkpoint's tensor.
Assigning or deleting a name bumps ``Weights.version`` and the plan is rebuilt from the dict on the next call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .arch.base import ModelConfig


class Weights(dict):
    """Resident weights by checkpoint name; every assignment or deletion bumps ``version``."""

    version = 0

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        self.version += 1

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        self.version += 1

    def pop(self, key: str, *default: Any) -> Any:
        self.version += 1
        return super().pop(key, *default)


@dataclass
class Fused:
    """``F.linear(x, weight, bias)`` whose output splits into ``sizes`` (one per member matrix)."""

    weight: Any  # a tensor, or a callable quantized linear (``bias`` then None)
    bias: torch.Tensor | None
    sizes: list[int]


@dataclass
class LayerPlan:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Fused | None  # GQA attention; None for MLA (which reads ``Weights`` by name)
    o_proj: Fused | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    mlp: Fused | None  # dense MLP or shared expert: [gate; up(; shared gate row)]
    down: Fused | None
    router: torch.Tensor | None  # MoE layers
    correction_bias: torch.Tensor | None


def fuse(w: Weights, names: list[str]) -> Fused:
    """One matrix for the linears ``names`` (checkpoint prefixes); their weights become views into it."""
    weights = [w[f"{n}.weight"] for n in names]
    biases = [w.get(f"{n}.bias") for n in names]
    sizes = [t.shape[0] for t in weights]
    if len(names) == 1:
        return Fused(weights[0], biases[0], sizes)
    if any(b is not None for b in biases):
        biases = [b if b is not None else t.new_zeros(t.shape[0]) for b, t in zip(biases, weights)]
    weight = _concat(w, [f"{n}.weight" for n in names], weights)
    bias = _concat(w, [f"{n}.bias" for n in names], biases) if biases[0] is not None else None
    return Fused(weight, bias, sizes)


def _concat(w: Weights, keys: list[str], parts: list[torch.Tensor]) -> torch.Tensor:
    base = parts[0]._base
    if base is not None and _are_consecutive_rows(base, parts):
        return base  # fused before (this plan is a rebuild): reuse, no copy
    fused = torch.cat(parts)
    start = 0
    for key, t in zip(keys, parts):
        if key in w:
            dict.__setitem__(w, key, fused[start : start + t.shape[0]])  # a view: no version bump, no copy kept
        start += t.shape[0]
    return fused


def _are_consecutive_rows(base: torch.Tensor, parts: list[torch.Tensor]) -> bool:
    offset = base.storage_offset()
    for t in parts:
        if t._base is not base or t.storage_offset() != offset or not t.is_contiguous():
            return False
        offset += t.numel()
    return offset == base.storage_offset() + base.numel()


def build_plan(config: ModelConfig, w: Weights, layer_names: list) -> list[LayerPlan]:
    plans = []
    for i, n in enumerate(layer_names):
        a = n.attn
        qkv = q_norm = k_norm = None
        if config.mla is None:
            qkv = fuse(w, [f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"])
            q_norm, k_norm = w.get(f"{a}.q_norm.weight"), w.get(f"{a}.k_norm.weight")
        mlp = down = router = bias = None
        if config.is_moe_layer(i):
            router = w[f"{n.mlp}.gate.weight"]
            bias = w.get(f"{n.mlp}.gate.e_score_correction_bias")
            if config.shared_expert_intermediate_size:
                shared = f"{n.mlp}.shared_expert" if config.shared_expert_gated else f"{n.mlp}.shared_experts"
                extra = [f"{n.mlp}.shared_expert_gate"] if config.shared_expert_gated else []
                mlp = fuse(w, [f"{shared}.gate_proj", f"{shared}.up_proj", *extra])
                down = fuse(w, [f"{shared}.down_proj"])
        else:
            mlp = fuse(w, [f"{n.mlp}.gate_proj", f"{n.mlp}.up_proj"])
            down = fuse(w, [f"{n.mlp}.down_proj"])
        plans.append(LayerPlan(w[f"{n.input_norm}.weight"], w[f"{n.post_attn_norm}.weight"], qkv,
                               fuse(w, [f"{a}.o_proj"]), q_norm, k_norm, mlp, down, router, bias))
    return plans
