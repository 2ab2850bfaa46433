"""A layer's experts as checked blobs, not decoded experts: the scheduler's public surface for a caller that computes
from the store's bytes itself (``runtime.staged_prefill``, grouped prefill at a budget).

:meth:`LayerBlobs.layer_blobs` takes each expert's blob from where the run holds it: a read ahead or a demand read in
flight (its buffer back to the pool once the caller is done with the blob), the host tier, a cached expert whose read
buffer is its memory (the CPU's zero-copy cache), else a demand read now (the fetch engine checks every read's CRC).
It counts each use in the scheduler's statistics as :meth:`Scheduler.stream` would (hit, prefetch hit or miss).

A mixin of :class:`~fate_edge.runtime.scheduler.Scheduler`, whose state it shares (declared below), as
``runtime.tier_path`` is.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from fate_edge.fetch.fetch_engine import FetchRequest, Priority

if TYPE_CHECKING:
    from fate_edge.fetch.buffer_pool import Buffer
    from fate_edge.fetch.fetch_engine import FetchEngine
    from fate_edge.format.store import ExpertStore
    from fate_edge.runtime.cache import AccessInfo
    from fate_edge.runtime.host_tier import HostTier
    from fate_edge.runtime.policy import PolicyConfig
    from fate_edge.runtime.scheduler_stats import SchedulerStats

Key = tuple[int, int]


@dataclass
class Fetch:
    """A store read the scheduler tracks: a read ahead (``prefetched``) or a demand read."""

    req: FetchRequest
    bits: int
    prefetched: bool
    lent: bool = False  # decoded in its read buffer, released after use (lends)


class LayerBlob(NamedTuple):
    expert: int
    blob: memoryview  # valid until the caller asks for the next one
    source: str  # "host", "cache", "prefetched" or "demand"


class LayerBlobs:
    host: HostTier | None
    fetch: FetchEngine
    store: ExpertStore
    policy: PolicyConfig
    stats: SchedulerStats
    prefetches: dict[Key, Fetch]
    demands: dict[Key, Fetch]
    _kept: dict[Key, Buffer]

    # Scheduler's and TierPath's
    def _drop(self, f: Fetch, wasted: bool = True, wait: bool = True) -> None:
        raise NotImplementedError

    def _submit(self, key: Key, bits: int, priority: Priority) -> FetchRequest:
        raise NotImplementedError

    def _issue_deferred(self) -> None:
        raise NotImplementedError

    def _take(self, f: Fetch) -> memoryview:
        raise NotImplementedError

    def _into_tier(
        self, key: Key, req: FetchRequest, payload: memoryview, info: AccessInfo | None
    ) -> Callable[[], object] | None:
        raise NotImplementedError

    def _count_use(self, layer: int, kind: int) -> None:
        raise NotImplementedError

    def _prefetch_used(self, layer: int, nbytes: int) -> None:
        raise NotImplementedError

    def layer_blobs(
        self, layer: int, ids: list[int], on_read: Callable[[Key], object] | None = None
    ) -> Iterator[LayerBlob]:
        """Each of ``layer``'s experts ``ids`` as its checked blob in the policy's precision: held ones first, then
        reads in the order they land; each read's buffer back to the pool once its blob is used (when the caller asks
        for the next). ``on_read``: called with the key of each store read this call submits."""
        bits = self.policy.bits
        pending: dict[int, Fetch] = {}
        for e in ids:
            key = (layer, e)
            f = self.prefetches.pop(key, None) or self.demands.pop(key, None)
            if f is not None and f.bits != bits:  # a cold copy read ahead: the caller reads the policy's precision
                self._drop(f)
                f = None
            if f is not None:
                pending[e] = f
            elif self.host is not None and self.host.holds(key, bits):
                self._count_blob("host", layer)
                yield LayerBlob(e, self.host.blob(key), "host")  # used before the next: nothing can evict it meanwhile
            elif key in self._kept:  # the CPU's zero-copy cache: the cached expert's memory is its read buffer
                self._count_blob("cache", layer)
                yield LayerBlob(e, self._kept[key].view[: self.store.ref(layer, e, bits).length], "cache")
            else:  # nothing holds its blob (or the cache holds it decoded): read it now
                if on_read is not None:
                    on_read(key)
                pending[e] = Fetch(self._submit(key, bits, Priority.DEMAND), bits, False)  # a tier slot if admitted
        self._issue_deferred()  # this layer's reads ahead left the scheduler's table: room for the layers ahead
        try:
            while pending:
                ready = [e for e, f in pending.items() if f.req.done.is_set()]
                if not ready:
                    t0 = time.perf_counter()
                    with self.fetch.completed:
                        if not any(f.req.done.is_set() for f in pending.values()):
                            self.fetch.completed.wait(timeout=0.05)
                    self.stats.stall_s += time.perf_counter() - t0
                    continue
                for e in ready:
                    f = pending.pop(e)
                    try:
                        payload = self._take(f)
                        self._into_tier((layer, e), f.req, payload, None)  # kept in host memory: no store read next
                        source = "prefetched" if f.prefetched else "demand"
                        self._count_blob(source, layer, nbytes=f.req.ref.length)
                        yield LayerBlob(e, payload, source)
                    finally:
                        self.fetch.release(f.req)
        except BaseException:  # a failed read, or the request abandoned mid-layer: every buffer back
            for f in pending.values():
                self._drop(f, wasted=False)
            raise

    def _count_blob(self, source: str, layer: int, nbytes: int = 0) -> None:
        """A blob's use in the statistics: a hit (host tier, cache), a prefetch hit, or a miss."""
        if source in ("host", "cache"):
            self.stats.hits += 1
            self._count_use(layer, 0)
        elif source == "prefetched":
            self._prefetch_used(layer, nbytes)
        else:
            self.stats.misses += 1
            self.stats.demand_bytes += nbytes
            self._count_use(layer, 2)
