"""The fewest expert reads any cache of a given size could make on a recorded run: the bound on how far a cache
policy can lower the expert bytes a batch reads per token (docs/batching.md, "How far a cache could lower the reads").

A run is recorded as its MoE layer calls in order (:class:`CallRecorder`, an observer of the routing): one call is a
layer computing the union of its rows' experts, one token's k alone, ~10 of 16 for 8 sequences at once on the bundled
model. :func:`fewest_reads` replays the calls through the engine's own cache (``ExpertCache``) with Belady-MIN
eviction (``runtime.cache.belady``, clairvoyant, with bypass) in one partition over every layer: no policy, no
per-layer split and no read ahead can read fewer experts than it on the same calls with the same room (read ahead
moves a read earlier, it does not remove it).
"""

from __future__ import annotations

import torch

from fate_edge.runtime.cache import AccessInfo
from fate_edge.runtime.cache.belady import Belady
from fate_edge.runtime.cache.expert_cache import ExpertCache

Call = tuple[int, frozenset[int]]  # (layer, the distinct experts it computes)


class CallRecorder:
    """An observer of the routing: every MoE layer call as (layer, its distinct experts), in order."""

    needs_every_token = False  # routing only: a prompt's last layer may still run on its last row

    def __init__(self) -> None:
        self.calls: list[Call] = []

    def __call__(self, layer: int, h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> None:
        self.calls.append((layer, frozenset(idx.flatten().tolist())))

    def take(self) -> list[Call]:
        """The calls recorded so far, forgetting them."""
        calls, self.calls = self.calls, []
        return calls


def fewest_reads(calls: list[Call], capacity: int, num_layers: int) -> int:
    """Expert reads of Belady-MIN (with bypass) over ``calls``, with room for ``capacity`` experts of any layers,
    starting empty: the fewest any cache of that size could make."""
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0 experts, got {capacity}")
    policy = Belady(future=calls)
    cache = ExpertCache({0: capacity}, lambda part, cap: policy, 1, partition_of=lambda key: 0)
    reads = 0
    for layer, ids in calls:
        info = AccessInfo(layer_now=layer, num_layers=num_layers)
        for e in sorted(ids, key=lambda e: ((layer, e) not in cache, e)):  # hits first, as the scheduler serves them
            key = (layer, e)
            hit = key in cache
            cache.access(key, hit, info)
            if not hit:
                reads += 1
                cache.insert(key, None, 1, 4)
    return reads
