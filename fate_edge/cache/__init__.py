"""The expert cache and its allocation and eviction policies (DESIGN §6)."""

from .allocation import allocate, cost_aware, shallow_favoring, uniform
from .belady import Belady
from .eviction import ARC, LCU, LFU, LRU, AccessInfo, DecayedPopularity, EvictionPolicy, make_eviction
from .expert_cache import CacheEntry, ExpertCache
from .next_use import NextUse, NextUseConfig

__all__ = [
    "ARC", "LCU", "LFU", "LRU", "AccessInfo", "Belady", "CacheEntry", "DecayedPopularity", "EvictionPolicy",
    "ExpertCache", "NextUse", "NextUseConfig", "allocate", "cost_aware", "make_eviction", "shallow_favoring", "uniform",
]
