"""The expert cache: decoded experts under a hard byte capacity, split into partitions.

A partition is one MoE layer (per-layer allocation, as Fate and mixtral-offloading do) or the whole
cache (one global partition). Each partition has its own eviction policy instance. Entries in use or
awaited can be pinned; a pinned entry is never evicted, and an insert that would need to evict one
is refused rather than exceeding the capacity: the budget is a hard limit. A policy may also decline an insert
(bypass: the incoming expert is expected back later than the victim would be).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from fate_edge.runtime.cache.eviction import AccessInfo, EvictionPolicy, Key


@dataclass
class CacheEntry:
    key: Key
    expert: Any  # a callable expert (ExpertWeights or QuantizedExpert)
    nbytes: int
    bits: int
    pins: int = 0


_serials = itertools.count()


class ExpertCache:
    def __init__(
        self,
        partition_bytes: dict[int, int],
        make_policy: Callable[[int, int], EvictionPolicy],
        entry_bytes: int,
        partition_of: Callable[[Key], int] | None = None,
        entry_bytes_of: dict[int, int] | None = None,
    ):
        """``partition_bytes``: partition id → capacity; ``make_policy(partition, capacity_in_entries)``;
        ``partition_of(key)``: defaults to the key's layer (per-layer partitions); ``entry_bytes_of``: partitions
        whose entries are another size than ``entry_bytes`` (Fate's first layer, resident in full precision)."""
        self.capacity = dict(partition_bytes)
        self.entry_bytes = entry_bytes
        self.partition_of = partition_of or (lambda key: key[0])
        self._sizes = entry_bytes_of or {}
        self._other_sizes = set(self._sizes)
        self.slots = self._slots()  # entries each partition holds
        self.resized = 0  # capacity changes (shrink): what was decided from the slots may no longer hold
        self.policies = {p: make_policy(p, max(1, n)) for p, n in self.slots.items()}
        self.per_layer: dict[int, int] = {}  # MoE layer → entries held (whatever the partitioning)
        self.entries: dict[Key, CacheEntry] = {}
        # Each partition's keys in insertion order (the order of ``entries``): an eviction looks at its own partition
        # only, where a scan of every entry cost a partition_of call each (~900 a batched step of the bundled model)
        self._members: dict[int, dict[Key, None]] = {p: {} for p in self.capacity}
        self.used: dict[int, int] = {p: 0 for p in self.capacity}
        self.evictions = 0
        self.refused = 0
        self.bypassed = 0  # inserts the policy declined (cache.eviction.EvictionPolicy.admit)
        self.on_evict: Callable[[Key], None] | None = None  # told each key that leaves (its memory is free)
        # Entries admitted or let go, counted from this cache's own start (``serial``, no other cache's): what was
        # read from ``entries`` holds while both stay
        self.serial, self.changes = next(_serials), 0

    def _slots(self) -> dict[int, int]:
        return {p: cap // max(1, self._sizes.get(p, self.entry_bytes)) for p, cap in self.capacity.items()}

    @property
    def capacity_bytes(self) -> int:
        return sum(self.capacity.values())

    @property
    def used_bytes(self) -> int:
        return sum(self.used.values())

    def free_entries(self, nbytes: int) -> int:
        """How many more ``nbytes`` entries the partitions of standard-size entries hold without evicting."""
        return (
            sum(max(0, cap - self.used[p]) // nbytes for p, cap in self.capacity.items() if p not in self._other_sizes)
            if nbytes > 0
            else 0
        )

    def holds_all(self, keys: Iterable[Key]) -> bool:
        """Every one of ``keys`` fits at once, each at its partition's entry size: none would ever be evicted."""
        need = Counter(self.partition_of(k) for k in keys)
        return all(n <= self.slots.get(p, 0) for p, n in need.items())

    def __contains__(self, key: Key) -> bool:
        return key in self.entries

    def get(self, key: Key) -> CacheEntry | None:
        return self.entries.get(key)

    def access(self, key: Key, hit: bool, info: AccessInfo) -> None:
        part = self.partition_of(key)
        if part in self.policies:
            self.policies[part].on_access(key, hit, info)

    def pin(self, key: Key) -> None:
        if key in self.entries:
            self.entries[key].pins += 1

    def unpin(self, key: Key) -> None:
        e = self.entries.get(key)
        if e is not None and e.pins > 0:
            e.pins -= 1

    def has_room(self, key: Key, nbytes: int) -> bool:
        """``key`` is cached, or fits in its partition's free bytes without evicting anything."""
        part = self.partition_of(key)
        return key in self.entries or self.used.get(part, 0) + nbytes <= self.capacity.get(part, 0)

    def insert(self, key: Key, expert: Any, nbytes: int, bits: int) -> bool:
        """Admit ``expert``; evicts unpinned residents of its partition as needed. False if it cannot fit."""
        if key in self.entries:
            return True
        part = self.partition_of(key)
        cap = self.capacity.get(part, 0)
        if nbytes > cap:
            self.refused += 1
            return False
        policy = self.policies[part]
        while self.used[part] + nbytes > cap:
            candidates = [k for k in self._members[part] if self.entries[k].pins == 0]
            if not candidates:
                self.refused += 1
                return False
            victim = policy.victim(candidates, incoming=key)
            if not policy.admit(key, victim):  # the policy expects the incoming one back later than the victim
                self.bypassed += 1
                return False
            self._evict(victim)
        self.entries[key] = CacheEntry(key, expert, nbytes, bits)
        self.changes += 1
        self._members[part][key] = None
        self.used[part] += nbytes
        self.per_layer[key[0]] = self.per_layer.get(key[0], 0) + 1
        policy.on_insert(key)
        assert self.used[part] <= cap
        return True

    def _evict(self, key: Key) -> None:
        e = self.entries.pop(key)
        self.changes += 1
        self.per_layer[key[0]] -= 1
        part = self.partition_of(key)
        del self._members[part][key]
        self.used[part] -= e.nbytes
        self.policies[part].on_evict(key)
        self.evictions += 1
        if self.on_evict is not None:
            self.on_evict(key)

    def discard(self, key: Key) -> None:
        """Drop ``key`` whatever its pins (its contents turned out unusable: a read into it failed)."""
        if key in self.entries:
            self._evict(key)

    def clear(self) -> None:
        """Drop every entry (the engine is closing): the experts' memory is freed now, not at the next GC."""
        for key in list(self.entries):
            self.entries[key].pins = 0
            self._evict(key)

    def shrink(self, nbytes: int) -> bool:
        """Take ``nbytes`` of the capacity, from each partition in proportion to its share, evicting its least wanted
        unpinned entries (the partition's own policy picks them) until it fits. Each policy keeps the entry count it
        was built with as its size hint. False where pinned entries leave a partition over its new capacity."""
        total = self.capacity_bytes
        if nbytes <= 0 or total <= 0:
            return True
        take = {p: min(cap, -(-nbytes * cap // total)) for p, cap in self.capacity.items()}
        for p, cut in take.items():
            self.capacity[p] -= cut
        self.slots, self.resized = self._slots(), self.resized + 1  # holds_all answers for the new capacity
        for p in take:
            while self.used[p] > self.capacity[p]:
                members = [k for k in self._members[p] if self.entries[k].pins == 0]
                if not members:
                    return False
                self._evict(self.policies[p].victim(members, incoming=None))
        return True

    def holds_layer(self, layer: int, num_experts: int) -> bool:
        """Every one of the layer's ``num_experts`` experts is cached."""
        return self.per_layer.get(layer, 0) >= num_experts

    def resident_layers(self, layer: int) -> set[int]:
        return {k[1] for k in self.entries if k[0] == layer}

    def new_sequence(self) -> None:
        for p in self.policies.values():
            p.new_sequence()
