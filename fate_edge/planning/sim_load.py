"""What the engine holds before the first request, for the simulator: Fate's resident first layer and the cache
filled at load. Mirrors ``Engine._resident`` and ``Engine._preload`` on sizes alone, so a simulated preset starts
from the cache its engine run starts from (a preset filled at load and simulated cold was predicted from another
start than the one measured)."""

from __future__ import annotations

from collections.abc import Sequence

from fate_edge.runtime.cache.factory import Resident, layer_slots, pick_resident
from fate_edge.runtime.policy import PolicyConfig
from fate_edge.runtime.preload import global_choice, preload_choice


def sim_resident(
    policy: PolicyConfig, layers: Sequence[int], num_experts: int, cache_bytes: int, entry_bytes: dict[int, int]
) -> Resident | None:
    """Fate's first MoE layer held whole (``resident_first``), at the highest precision of ``entry_bytes``
    (bits → bytes of one expert) that fits ``cache_bytes``; None for other policies, as ``Engine._resident``."""
    if not (policy.resident_first and policy.cache and policy.allocation != "global"):
        return None
    return pick_resident(layers[0], num_experts, cache_bytes, entry_bytes)


def sim_preload(
    policy: PolicyConfig,
    layers: Sequence[int],
    num_experts: int,
    cache_bytes: int,
    entry_bytes: int,
    popularity: dict[int, list[int]] | None,
    resident: Resident | None,
) -> dict[int, list[int]] | None:
    """Per MoE layer the experts the engine caches at load (``preload``: the calibration's most used, across layers
    for one global partition, per layer's slots otherwise; the resident layer whole), or None."""
    if not policy.cache or not (policy.preload or resident):
        return None
    if policy.preload and policy.allocation == "global":
        return global_choice(cache_bytes // entry_bytes, layers, num_experts, popularity)
    if policy.preload:
        left = cache_bytes - (resident.nbytes if resident else 0)
        slots = layer_slots(policy, left // entry_bytes, layers, num_experts, popularity, resident)
    else:
        assert resident is not None  # neither preload nor resident returned above
        slots = {resident.layer: num_experts}
    return preload_choice(slots, num_experts, popularity)
