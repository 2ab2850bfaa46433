"""Build the expert cache a policy describes (used by the engine and by the trace simulator alike)."""

from __future__ import annotations

from collections.abc import Sequence

from ..policy import PolicyConfig
from .allocation import allocate
from .eviction import make_eviction
from .expert_cache import ExpertCache


def layer_slots(policy: PolicyConfig, slots: int, moe_layers: Sequence[int], num_experts: int) -> dict[int, int]:
    """Per-layer slot counts of the policy's allocation (empty for one global partition)."""
    if policy.allocation == "global":
        return {}
    if policy.allocation == "shallow":
        return allocate("shallow", slots, moe_layers, num_experts, full_layers=policy.full_layers)
    return allocate("uniform", slots, moe_layers, num_experts)


def build_cache(policy: PolicyConfig, cache_bytes: int, entry_bytes: int, moe_layers: Sequence[int],
                num_experts: int, future: list | None = None) -> ExpertCache | None:
    """The cache for ``policy`` with ``cache_bytes`` of capacity; ``future`` feeds Belady's clairvoyance."""
    if not policy.cache:
        return None
    kw = {"future": future or []} if policy.eviction == "belady" else {}

    def make(part: int, cap: int):
        return make_eviction(policy.eviction, cap, **kw)

    if policy.allocation == "global":
        return ExpertCache({0: cache_bytes}, make, entry_bytes, partition_of=lambda key: 0)
    slots = layer_slots(policy, cache_bytes // entry_bytes, moe_layers, num_experts)
    return ExpertCache({layer: s * entry_bytes for layer, s in slots.items()}, make, entry_bytes)
