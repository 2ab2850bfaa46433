"""A scheduler whose cache holds the whole model, seen as a provider of resident layers: a decode row may then run a
whole MoE layer in one native call (``fate_edge.model.decode_layer``) on the experts it hands out here, and the
scheduler notes the layer's uses afterwards as its groups would have.

A mixin of :class:`~fate_edge.runtime.scheduler.Scheduler`, whose state it shares (declared below), as
``runtime.layer_blobs`` is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fate_edge.runtime.cache import AccessInfo

if TYPE_CHECKING:
    from fate_edge.model.arch.base import ModelConfig
    from fate_edge.model.experts import Expert
    from fate_edge.runtime.cache import ExpertCache
    from fate_edge.runtime.scheduler_stats import SchedulerStats

Key = tuple[int, int]


class ResidentLayers:
    cache: ExpertCache | None
    config: ModelConfig
    stats: SchedulerStats
    copier: Any
    prefetches: dict[Key, Any]
    deferred: dict[Key, Any]
    _dropping: list[Any]
    _landed: dict[Key, int]
    skip: set[Key]
    needs_every_token: bool
    _prefill: bool

    # Scheduler's
    def _all_cached(self) -> bool:
        raise NotImplementedError

    def _count_use(self, layer: int, kind: int) -> None:
        raise NotImplementedError

    def _release_lent(self) -> None:
        raise NotImplementedError

    def _busy(self) -> bool:
        """Reads in flight, waiting or being dropped, reads landed and not yet used, experts to skip: what ``end_layer``
        settles beyond the layer's pins."""
        return bool(
            self.prefetches or self.deferred or self._dropping or self._landed or self.skip or self.copier.in_flight
        )

    def resident_token(self) -> object | None:
        """(the cache's serial, its count of changes) where it holds the whole model and nothing is in flight or
        waits (what ``end_layer``'s short path asks), else None: until an entry comes or goes, :meth:`resident_layer`'s
        experts stay."""
        if self._busy() or self.needs_every_token or not self._all_cached():
            return None
        assert self.cache is not None  # _all_cached
        return self.cache.serial, self.cache.changes

    def resident_layer(self, layer: int, num_experts: int) -> list[Expert] | None:
        """Every cached expert of ``layer`` in id order (None: some are not cached)."""
        if self.cache is None:
            return None
        entries = [self.cache.get((layer, e)) for e in range(num_experts)]
        return None if any(e is None for e in entries) else [e.expert for e in entries if e is not None]

    def served_resident(self, layer: int, ids: list[int], seconds: float) -> None:
        """``stream_groups`` and ``end_layer`` for a layer served whole from a cache that holds the model
        (:meth:`resident_token`): each expert a hit the cache's policy sees, nothing pinned, the experts' compute
        timed as the group's."""
        assert self.cache is not None  # resident_token
        info = AccessInfo(layer_now=layer, num_layers=self.config.num_hidden_layers)
        for e in ids:
            self.cache.access((layer, e), True, info)
            self._count_use(layer, 0)
        self.stats.hits += len(ids)
        if not self._prefill and ids:
            self.stats.expert_s += seconds
            self.stats.experts_timed += len(ids)
        self._release_lent()
