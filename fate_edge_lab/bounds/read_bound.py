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

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from fate_edge.runtime.cache import AccessInfo
from fate_edge.runtime.cache.belady import Belady
from fate_edge.runtime.cache.expert_cache import ExpertCache

if TYPE_CHECKING:
    from fate_edge.runtime.engine import Engine

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
    starting empty: the fewest any cache of that size could make. A cache filled before the calls (with whatever
    they need first) saves at most ``capacity`` of them: :func:`fewest_reads_warm`."""
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


def fewest_reads_warm(calls: list[Call], capacity: int, num_layers: int) -> int:
    """The fewest reads of ``calls`` for a cache of ``capacity`` experts filled beforehand at no cost with the best
    experts to hold (MIN's own first ``capacity`` distinct ones): what no cache, preloaded or warm, can go below."""
    return max(0, fewest_reads(calls, capacity, num_layers) - capacity)


def engine_rooms(engine: Engine) -> dict[str, int]:
    """The rooms the bound is taken in, in experts of the engine's precision: what its cache gets of the budget (its
    read buffers apart), and the whole budget as cache."""
    expert_bytes = engine.store.expert_bytes(engine.policy.bits)
    return {"cache_room": engine.plan.cache_bytes // expert_bytes, "whole_budget": engine.budget // expert_bytes}


def decode_reads(engine: Engine, responses: Iterable[Any]) -> tuple[list[Any], dict]:
    """Serve one request's ``responses`` (``engine.stream(...)``, one request at a time on this thread), recording its
    MoE calls → (the responses, its decode's figures per decode token): the engine's expert reads (demand, prefetch
    and wasted) and the fewest any cache could make (:func:`fewest_reads_warm`) in the room the engine's cache has
    and in the whole budget; the read bandwidth the engine's reads had (GB/s, None before any read)."""
    store, model = engine.store, engine.model
    expert_bytes = store.expert_bytes(engine.policy.bits)
    layers = len(store.index["moe_layers"])
    rec = CallRecorder()
    model.observers.append(rec)
    out, first, start = [], None, 0
    fetched = engine.fetch.stats
    f0 = (fetched.bytes_read, fetched.read_s)
    try:
        for r in responses:
            out.append(r)
            if first is None:  # the prompt is done: the decode's reads start here
                first, start = engine.stats.snapshot(), len(rec.calls)
    finally:
        model.observers.remove(rec)
    decoded = len(out) - 1
    if first is None or decoded < 1:
        raise ValueError("decode_reads needs a request of two tokens or more")
    s = engine.stats.minus(first)
    rooms = engine_rooms(engine)
    decode = rec.calls[start:]
    read_bytes, read_s = fetched.bytes_read - f0[0], fetched.read_s - f0[1]
    return out, {
        "decode_tokens": decoded,
        "expert_bytes": expert_bytes,
        "experts": rooms | {"all": layers * store.index["num_experts"]},
        "hit_rate": s.hit_rate,
        "engine_reads_per_token": (s.demand_bytes + s.prefetch_bytes + s.wasted_bytes) / expert_bytes / decoded,
        "fewest_reads_per_token": {k: fewest_reads_warm(decode, n, layers) / decoded for k, n in rooms.items()},
        "read_gbps": read_bytes / read_s / 1e9 if read_s > 0 else None,
    }
