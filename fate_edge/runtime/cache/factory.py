"""Build the expert cache a policy describes (used by the engine and by the trace simulator alike)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fate_edge.runtime.cache.allocation import allocate
from fate_edge.runtime.cache.belady import Belady
from fate_edge.runtime.cache.eviction import ARC, LCU, LFU, LRU, DecayedPopularity, EvictionPolicy
from fate_edge.runtime.cache.expert_cache import ExpertCache
from fate_edge.runtime.cache.next_use import NextUse, NextUseConfig, seed_shares
from fate_edge.runtime.policy import PolicyConfig
from fate_edge.sizes import format_bytes


def miss_curves(popularity: Mapping[int, Sequence[int]]) -> dict[int, list[float]]:
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


@dataclass(frozen=True)
class Resident:
    """A MoE layer held whole from load to close (Fate's first layer): its own partition, entries of its size."""

    layer: int
    bits: int  # precision held (16: full precision)
    entry_bytes: int  # one decoded expert at ``bits``
    num_experts: int
    note: str = ""  # why this precision (a fallback says so)

    @property
    def nbytes(self) -> int:
        return self.entry_bytes * self.num_experts


def precision_name(bits: int) -> str:
    return "bf16" if bits == 16 else f"int{bits}"


def pick_resident(layer: int, num_experts: int, cache_bytes: int, entry_bytes: dict[int, int]) -> Resident | None:
    """Fate's first layer in the highest precision of ``entry_bytes`` (bits → decoded bytes) whose whole layer
    fits in ``cache_bytes``; None when none does (the layer is then cached like any other)."""
    best = max(entry_bytes)
    for bits in sorted(entry_bytes, reverse=True):
        need = num_experts * entry_bytes[bits]
        if need <= cache_bytes:
            note = (
                ""
                if bits == best
                else (
                    f"{precision_name(best)} would need "
                    f"{format_bytes(num_experts * entry_bytes[best])} of the "
                    f"{format_bytes(cache_bytes)} cache: held as {precision_name(bits)}"
                )
            )
            return Resident(layer, bits, entry_bytes[bits], num_experts, note)
    return None


def layer_slots(
    policy: PolicyConfig,
    slots: int,
    moe_layers: Sequence[int],
    num_experts: int,
    popularity: Mapping[int, Sequence[int]] | None = None,
    resident: Resident | None = None,
) -> dict[int, int]:
    """Per-layer slot counts of the policy's allocation (empty for one global partition).

    ``cost-aware`` needs calibration popularity (``fate-edge calibrate``); without it the split is uniform.
    ``resident``: a layer held whole outside ``slots`` (the bytes left once it is paid for); under
    shallow-favoring it counts as one of the ``full_layers``.
    """
    if resident is not None:
        rest = [layer for layer in moe_layers if layer != resident.layer]
        full = max(0, policy.full_layers - 1)
        return {
            resident.layer: num_experts,
            **layer_slots(policy.with_(full_layers=full), slots, rest, num_experts, popularity),
        }
    if policy.allocation == "global":
        return {}
    if policy.allocation == "shallow":
        return allocate("shallow", slots, moe_layers, num_experts, full_layers=policy.full_layers)
    if policy.allocation == "cost-aware" and popularity and all(layer in popularity for layer in moe_layers):
        return allocate("cost-aware", slots, moe_layers, num_experts, miss_curves=miss_curves(popularity))
    return allocate("uniform", slots, moe_layers, num_experts)


def build_cache(
    policy: PolicyConfig,
    cache_bytes: int,
    entry_bytes: int,
    moe_layers: Sequence[int],
    num_experts: int,
    future: list | None = None,
    popularity: Mapping[int, Sequence[int]] | None = None,
    resident: Resident | None = None,
    top_k: int = 2,
) -> ExpertCache | None:
    """The cache for ``policy`` with ``cache_bytes`` of capacity; ``future`` feeds Belady's clairvoyance;
    ``resident``: a layer held whole, paid out of ``cache_bytes`` (the other layers share the rest); ``top_k``:
    experts per token per layer (next-use turns calibration shares into per-token rates with it)."""
    if not policy.cache:
        return None
    kw: dict = {"future": future or []} if policy.eviction == "belady" else {}
    if policy.eviction == "popularity" and popularity:
        # Seed each expert's score with its calibration share (the most used expert of a layer starts at 50).
        kw["seed_counts"] = {
            (layer, e): 50.0 * c / max(1, max(counts))
            for layer, counts in popularity.items()
            for e, c in enumerate(counts)
        }
    if policy.eviction == "next-use":
        kw.update(
            config=NextUseConfig(top_k=top_k),
            seed_share=seed_shares(popularity) if popularity else None,
            num_experts=num_experts,
        )

    def make(part: int, cap: int):
        return make_eviction(policy.eviction, cap, **kw)

    if policy.allocation == "global":
        return ExpertCache({0: cache_bytes}, make, entry_bytes, partition_of=lambda key: 0)
    left = cache_bytes - (resident.nbytes if resident else 0)
    slots = layer_slots(policy, left // entry_bytes, moe_layers, num_experts, popularity, resident)
    parts = {layer: s * entry_bytes for layer, s in slots.items()}
    if resident is None:
        return ExpertCache(parts, make, entry_bytes)
    parts[resident.layer] = resident.nbytes
    return ExpertCache(parts, make, entry_bytes, entry_bytes_of={resident.layer: resident.entry_bytes})


def make_eviction(name: str, capacity_entries: int = 1, **kw) -> EvictionPolicy:
    if name == "lru":
        return LRU()
    if name == "lfu":
        return LFU()
    if name == "arc":
        return ARC(capacity_entries)
    if name == "popularity":
        return DecayedPopularity(**kw)
    if name == "lcu":
        return LCU(**kw)
    if name == "belady":
        return Belady(**kw)
    if name == "next-use":
        return NextUse(**kw)
    raise ValueError(f"unknown eviction policy '{name}' (lru, lfu, arc, popularity, lcu, belady, next-use)")
