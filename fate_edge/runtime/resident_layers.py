"""A scheduler whose cache holds the whole model, seen as a provider of resident layers: a decode row may then run a
whole MoE layer in one native call (``fate_edge.model.decode_layer``) on the experts it hands out here, and the
scheduler notes the layer's uses afterwards as its groups would have. Under a budget the same call runs in two
phases, and a layer whose routed experts the cache holds takes them from :meth:`ResidentLayers.take_cached`, with
the bookkeeping :meth:`~fate_edge.runtime.scheduler.Scheduler.stream_groups` gives a cached expert (one helper).

A mixin of :class:`~fate_edge.runtime.scheduler.Scheduler`, whose state it shares (declared below), as
``runtime.layer_blobs`` is.
"""

from __future__ import annotations

from collections.abc import Callable
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

    def _prefetch_used(self, layer: int, nbytes: int) -> None:
        raise NotImplementedError

    def end_layer(self, layer: int) -> None:
        raise NotImplementedError

    in_use: list[Key]

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
        self._time_experts(len(ids), seconds)
        self._release_lent()

    @property
    def serves_cached_layers(self) -> bool:
        """Whether a decode row's layer may run in two native calls on experts :meth:`take_cached` hands out: a cache
        on the host, and no observer that needs every token the general path's way (a trace)."""
        return self.cache is not None and self.copier.device.type == "cpu" and not self.needs_every_token

    def cached_layer(self, layer: int) -> dict[int, Expert]:
        """The experts of ``layer`` the cache holds now (id → expert), unnoted: what a layer's program starts from."""
        if self.cache is None:
            return {}
        return {e: entry.expert for (lay, e), entry in self.cache.entries.items() if lay == layer}

    def take_cached(
        self, layer: int, ids: list[int], accept: Callable[[dict[int, Expert]], bool]
    ) -> list[Expert] | None:
        """``layer``'s experts ``ids`` (ascending) where the cache holds every one now and ``accept`` takes them (id →
        expert): each pinned and noted as :meth:`stream_groups` notes a cached expert (a hit, or a prefetch's first
        use), for the caller to compute and then :meth:`served_cached`; else None, nothing noted."""
        if self.cache is None:
            return None
        entries = [self.cache.get((layer, e)) for e in ids]
        if any(entry is None for entry in entries) or not accept(
            {e: entry.expert for e, entry in zip(ids, entries) if entry is not None}
        ):
            return None
        info = AccessInfo(layer_now=layer, num_layers=self.config.num_hidden_layers)
        return [self._use_cached((layer, e), entry, info) for e, entry in zip(ids, entries) if entry is not None]

    def _use_cached(self, key: Key, entry: Any, info: AccessInfo) -> Expert:
        """A cached expert handed out for its layer: pinned until ``end_layer``, its access noted, counted a hit or,
        where its read ahead landed early, a prefetch's use."""
        assert self.cache is not None  # the caller found the entry there
        self.cache.pin(key)
        self.in_use.append(key)
        self.cache.access(key, True, info)
        early = self._landed.pop(key, None)
        if early is None:
            self.stats.hits += 1
            self._count_use(key[0], 0)
        else:
            self._prefetch_used(key[0], early)
        return entry.expert

    def served_cached(self, layer: int, count: int, seconds: float) -> None:
        """:meth:`take_cached`'s ``count`` experts were computed in ``seconds``: the time noted as a group's, then
        ``end_layer``."""
        self._time_experts(count, seconds)
        self.end_layer(layer)

    def _time_experts(self, count: int, seconds: float) -> None:
        """``count`` experts of a decode row computed in ``seconds`` (a prompt's are not timed)."""
        if not self._prefill and count:
            self.stats.expert_s += seconds
            self.stats.experts_timed += count
