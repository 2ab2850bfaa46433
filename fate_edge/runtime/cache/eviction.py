"""Eviction policies for the expert cache. Each is a small class; the cache asks it for a victim.

Keys are ``(layer, expert)``. The cache tells a policy about every access (hit or miss), insertion
and eviction, and asks :meth:`EvictionPolicy.victim` to pick among the unpinned residents of one
partition. Policies never see bytes or tensors.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

Key = tuple[int, int]


@dataclass
class AccessInfo:
    """What the cache knows about one access."""

    layer_now: int = 0  # layer being computed when the access happens
    num_layers: int = 1
    low_precision: bool = False  # served by a low-precision copy (LCU weighs these less)


class EvictionPolicy:
    name = "base"

    def on_access(self, key: Key, hit: bool, info: AccessInfo) -> None:
        """Every use of an expert, whether it was cached or not."""

    def on_insert(self, key: Key) -> None:
        pass

    def on_evict(self, key: Key) -> None:
        pass

    def victim(self, candidates: Sequence[Key], incoming: Key | None = None) -> Key:
        raise NotImplementedError

    def admit(self, incoming: Key, victim: Key) -> bool:
        """Whether ``incoming`` is worth evicting ``victim`` for; False leaves the cache as it is (the expert serves
        this use from its read buffer only). Only policies that can compare the two bypass."""
        return True

    def new_sequence(self) -> None:
        """A new request starts (policies with per-sequence statistics reset them)."""


class LRU(EvictionPolicy):
    """Least recently used (mixtral-offloading, Eliseev & Mazur 2023: a per-layer LRU of experts)."""

    name = "lru"

    def __init__(self) -> None:
        self.clock = 0
        self.last: dict[Key, int] = {}

    def on_access(self, key: Key, hit: bool, info: AccessInfo) -> None:
        self.clock += 1
        self.last[key] = self.clock

    def on_insert(self, key: Key) -> None:
        self.last.setdefault(key, self.clock)

    def victim(self, candidates: Sequence[Key], incoming: Key | None = None) -> Key:
        return min(candidates, key=lambda k: (self.last.get(k, -1), k))


class LFU(EvictionPolicy):
    """Least frequently used, ties broken by recency (the LFU baseline MoE-APEX compares against)."""

    name = "lfu"

    def __init__(self) -> None:
        self.count: dict[Key, int] = defaultdict(int)
        self.lru = LRU()

    def on_access(self, key: Key, hit: bool, info: AccessInfo) -> None:
        self.count[key] += 1
        self.lru.on_access(key, hit, info)

    def victim(self, candidates: Sequence[Key], incoming: Key | None = None) -> Key:
        return min(candidates, key=lambda k: (self.count.get(k, 0), self.lru.last.get(k, -1), k))


class DecayedPopularity(EvictionPolicy):
    """Popularity with exponential decay, seeded from calibration traces (Fate's "popularity" ranking,
    WWW'26, arXiv 2502.12224, applied to eviction): score ← decay·score + 1 on each use."""

    name = "popularity"

    def __init__(self, decay: float = 0.99, seed_counts: dict[Key, float] | None = None):
        self.decay = decay
        self.score: dict[Key, float] = dict(seed_counts or {})
        self.stamp: dict[Key, int] = {}
        self.clock = 0

    def _value(self, key: Key) -> float:
        # Lazy decay: scale by decay^(time since last update) instead of touching every key per access.
        return self.score.get(key, 0.0) * self.decay ** (self.clock - self.stamp.get(key, self.clock))

    def on_access(self, key: Key, hit: bool, info: AccessInfo) -> None:
        self.clock += 1
        self.score[key] = self._value(key) + 1.0
        self.stamp[key] = self.clock

    def victim(self, candidates: Sequence[Key], incoming: Key | None = None) -> Key:
        return min(candidates, key=lambda k: (self._value(k), k))


class LCU(EvictionPolicy):
    """Least critical used, from MoE-APEX (HOBBIT, arXiv 2411.01433, ASPLOS'26).

    Cost C = H + (b_low/b_high)·L over high- and low-precision uses; priority p = C/T + 1/D when the
    expert was used in the previous forward pass, else C/T, with D = (l − l_now + L) mod L + 0.1 the
    layer distance ahead. Evict the lowest priority. Statistics reset per sequence.
    """

    name = "lcu"

    def __init__(self, low_high_ratio: float = 0.5):
        self.ratio = low_high_ratio
        self.new_sequence()

    def new_sequence(self) -> None:
        self.high: dict[Key, int] = defaultdict(int)
        self.low: dict[Key, int] = defaultdict(int)
        self.t = 0  # forward passes (tokens) seen in this sequence
        self.used_now: set[Key] = set()
        self.used_prev: set[Key] = set()
        self.last_layer = -1
        self.layer_now = 0
        self.num_layers = 1

    def on_access(self, key: Key, hit: bool, info: AccessInfo) -> None:
        if info.layer_now < self.last_layer:  # wrapped to layer 0: a new forward pass
            self.t += 1
            self.used_prev, self.used_now = self.used_now, set()
        self.last_layer = self.layer_now = info.layer_now
        self.num_layers = info.num_layers
        (self.low if info.low_precision else self.high)[key] += 1
        self.used_now.add(key)

    def priority(self, key: Key) -> float:
        cost = self.high.get(key, 0) + self.ratio * self.low.get(key, 0)
        p = cost / max(1, self.t + 1)
        if key in self.used_prev:
            distance = (key[0] - self.layer_now + self.num_layers) % self.num_layers + 0.1
            p += 1.0 / distance
        return p

    def victim(self, candidates: Sequence[Key], incoming: Key | None = None) -> Key:
        return min(candidates, key=lambda k: (self.priority(k), k))


class ARC(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST'03), as Fate ships per layer.

    T1 holds keys seen once recently, T2 keys seen at least twice; ghost lists B1/B2 remember keys
    evicted from each, and a hit in a ghost list moves the target size ``p`` of T1 towards the list
    that would have kept it. ``capacity`` is in entries (the cache converts bytes to slots).
    """

    name = "arc"

    def __init__(self, capacity: int):
        self.c = max(1, capacity)
        self.p = 0.0
        self.t1: OrderedDict[Key, None] = OrderedDict()
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()

    def on_access(self, key: Key, hit: bool, info: AccessInfo) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def on_insert(self, key: Key) -> None:
        if key in self.t1 or key in self.t2:
            return
        if key in self.b1:  # recency list was too small
            self.p = min(float(self.c), self.p + max(1.0, len(self.b2) / max(1, len(self.b1))))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:  # frequency list was too small
            self.p = max(0.0, self.p - max(1.0, len(self.b1) / max(1, len(self.b2))))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None
        self._trim_ghosts()

    def on_evict(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
            self.b1[key] = None
        elif key in self.t2:
            del self.t2[key]
            self.b2[key] = None
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        while len(self.b1) > self.c:
            self.b1.popitem(last=False)
        while len(self.b2) > self.c:
            self.b2.popitem(last=False)

    def victim(self, candidates: Sequence[Key], incoming: Key | None = None) -> Key:
        allowed = set(candidates)
        t1 = [k for k in self.t1 if k in allowed]  # LRU first
        t2 = [k for k in self.t2 if k in allowed]
        prefer_t1 = t1 and (len(self.t1) > self.p or (incoming in self.b2 and len(self.t1) == int(self.p)))
        if prefer_t1 or not t2:
            if t1:
                return t1[0]
        if t2:
            return t2[0]
        return candidates[0]  # residents the policy never saw (inserted before it was attached)
