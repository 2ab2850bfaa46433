"""Build the expert cache a policy describes (used by the engine and by the trace simulator alike)."""

from __future__ import annotations

from collections.abc import Sequence

from ..policy import PolicyConfig
from .allocation import allocate
from .eviction import make_eviction
from .expert_cache import ExpertCache


def miss_curves(popularity: dict[int, Sequence[int]]) -> dict[int, list[float]]:
    """Per layer, the miss rate with s slots holding its s most used experts (from calibration counts)."""
    curves = {}
    for layer, counts in popularity.items():
        ranked = sorted(counts, reverse=True)
        total = max(1, sum(ranked))
        acc, curve = 0, [1.0]
        for c in ranked:
            acc += c
            curve.append(1.0 - acc / total)
        curves[layer] = curve
    return curves


def layer_slots(policy: PolicyConfig, slots: int, moe_layers: Sequence[int], num_experts: int,
                popularity: dict[int, Sequence[int]] | None = None) -> dict[int, int]:
    """Per-layer slot counts of the policy's allocation (empty for one global partition).

    ``cost-aware`` needs calibration popularity (``fate-edge calibrate``); without it the split is uniform.
    """
    if policy.allocation == "global":
        return {}
    if policy.allocation == "shallow":
        return allocate("shallow", slots, moe_layers, num_experts, full_layers=policy.full_layers)
    if policy.allocation == "cost-aware" and popularity and all(layer in popularity for layer in moe_layers):
        return allocate("cost-aware", slots, moe_layers, num_experts, miss_curves=miss_curves(popularity))
    return allocate("uniform", slots, moe_layers, num_experts)


def build_cache(policy: PolicyConfig, cache_bytes: int, entry_bytes: int, moe_layers: Sequence[int],
                num_experts: int, future: list | None = None,
                popularity: dict[int, Sequence[int]] | None = None) -> ExpertCache | None:
    """The cache for ``policy`` with ``cache_bytes`` of capacity; ``future`` feeds Belady's clairvoyance."""
    if not policy.cache:
        return None
    kw: dict = {"future": future or []} if policy.eviction == "belady" else {}
    if policy.eviction == "popularity" and popularity:
        # Seed each expert's score with its calibration share (the most used expert of a layer starts at 50).
        kw["seed_counts"] = {(layer, e): 50.0 * c / max(1, max(counts))
                             for layer, counts in popularity.items() for e, c in enumerate(counts)}

    def make(part: int, cap: int):
        return make_eviction(policy.eviction, cap, **kw)

    if policy.allocation == "global":
        return ExpertCache({0: cache_bytes}, make, entry_bytes, partition_of=lambda key: 0)
    slots = layer_slots(policy, cache_bytes // entry_bytes, moe_layers, num_experts, popularity)
    return ExpertCache({layer: s * entry_bytes for layer, s in slots.items()}, make, entry_bytes)
