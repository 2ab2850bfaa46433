"""Allocation policies: how the expert-cache byte budget is split into per-layer partitions."""

from __future__ import annotations

from collections.abc import Sequence


def uniform(budget_slots: int, moe_layers: Sequence[int], num_experts: int) -> dict[int, int]:
    """The same number of slots for every MoE layer (mixtral-offloading's per-layer caches)."""
    n = len(moe_layers)
    base, extra = divmod(budget_slots, n)
    return {layer: min(num_experts, base + (1 if i < extra else 0)) for i, layer in enumerate(moe_layers)}


def shallow_favoring(
    budget_slots: int, moe_layers: Sequence[int], num_experts: int, full_layers: int = 4
) -> dict[int, int]:
    """Fate (WWW'26, arXiv 2502.12224): prediction is weakest in shallow layers, so cache them whole.

    With C slots and E experts per layer: if C < full_layers·E, fill layers 0, 1, ... completely in
    order; otherwise the first ``full_layers`` layers are fully cached and each deeper layer gets
    ⌊(C − full_layers·E)/(L − full_layers)⌋ slots. (Fate hard-codes full_layers = 4.) The ``fate`` preset
    holds its first MoE layer resident apart (cache/factory.py ``Resident``): this split then covers the other
    layers with ``full_layers − 1`` and the slots left once that layer is paid for.
    """
    e, layers = num_experts, list(moe_layers)
    out = {layer: 0 for layer in layers}
    if budget_slots < full_layers * e or len(layers) <= full_layers:
        left = budget_slots
        for layer in layers:
            out[layer] = min(e, left)
            left -= out[layer]
        return out
    rest = (budget_slots - full_layers * e) // (len(layers) - full_layers)
    for i, layer in enumerate(layers):
        out[layer] = e if i < full_layers else min(e, rest)
    return out


def cost_aware(
    budget_slots: int,
    moe_layers: Sequence[int],
    num_experts: int,
    miss_curves: dict[int, Sequence[float]],
    miss_cost: dict[int, float] | None = None,
) -> dict[int, int]:
    """Greedy marginal-gain split (our extension of Fate's fixed rule; in the spirit of MoE-Lightning's
    policy search): ``miss_curves[layer][s]`` is the layer's miss rate with ``s`` slots, measured on
    calibration traces; each slot goes to the layer whose expected stall time drops most by it."""
    cost = miss_cost or {layer: 1.0 for layer in moe_layers}
    out = {layer: 0 for layer in moe_layers}
    for _ in range(min(budget_slots, num_experts * len(moe_layers))):

        def gain(layer: int) -> float:
            s = out[layer]
            curve = miss_curves[layer]
            if s >= num_experts:
                return -1.0
            return (curve[s] - curve[min(s + 1, len(curve) - 1)]) * cost[layer]

        best = max(moe_layers, key=lambda layer: (gain(layer), -layer))
        if gain(best) < 0:
            break
        out[best] += 1
    return out


def allocate(name: str, budget_slots: int, moe_layers: Sequence[int], num_experts: int, **kw) -> dict[int, int]:
    if name == "uniform":
        return uniform(budget_slots, moe_layers, num_experts)
    if name == "shallow":
        return shallow_favoring(budget_slots, moe_layers, num_experts, **kw)
    if name == "cost-aware":
        return cost_aware(budget_slots, moe_layers, num_experts, **kw)
    raise ValueError(f"unknown allocation policy '{name}' (uniform, shallow, cost-aware)")
