"""The expert cache and its allocation and eviction policies (docs/architecture.md §6)."""

from fate_edge.runtime.cache.allocation import allocate, cost_aware, shallow_favoring, uniform
from fate_edge.runtime.cache.belady import Belady
from fate_edge.runtime.cache.eviction import (
    ARC,
    LCU,
    LFU,
    LRU,
    AccessInfo,
    DecayedPopularity,
    EvictionPolicy,
)
from fate_edge.runtime.cache.expert_cache import CacheEntry, ExpertCache
from fate_edge.runtime.cache.factory import make_eviction
from fate_edge.runtime.cache.next_use import NextUse, NextUseConfig

__all__ = [
    "ARC",
    "LCU",
    "LFU",
    "LRU",
    "AccessInfo",
    "Belady",
    "CacheEntry",
    "DecayedPopularity",
    "EvictionPolicy",
    "ExpertCache",
    "NextUse",
    "NextUseConfig",
    "allocate",
    "cost_aware",
    "make_eviction",
    "shallow_favoring",
    "uniform",
]
