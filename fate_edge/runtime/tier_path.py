"""The scheduler's path through the tiers on a GPU (DESIGN §10): device cache ← host tier ← the store.

* A device miss the host tier holds (runtime.host_tier) is copied from its slot, with no store read, or, under policy
  ``miss_compute="hybrid"``, computed on the CPU where it lies (runtime.cpu_miss) where the per-miss rule finds that
  cheaper (runtime.miss_rule).
* A store read the host tier admits lands straight in its slot (no staging buffer), valid once its CRC is checked.
* A prefetched expert is made ready as its read lands (uploaded, decoded, cached), not when its layer asks for it
  (``Scheduler.land_early``: on a GPU, where the copy overlaps compute); one the host tier holds is copied up at
  once. Its layer then finds it cached and counts it a prefetch hit.

A mixin of :class:`~fate_edge.runtime.scheduler.Scheduler`, whose state it shares (declared below).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch

from fate_edge.fetch.fetch_engine import FetchRequest, Priority
from fate_edge.format.store import decode_expert
from fate_edge.model.experts import Expert
from fate_edge.runtime.cache import AccessInfo
from fate_edge.runtime.cpu_miss import OnHost
from fate_edge.runtime.held_bytes import held_bytes
from fate_edge.runtime.miss_rule import CPU, MissRule
from fate_edge.runtime.portable_expert import PortableExpert, keeps_in_place

if TYPE_CHECKING:
    from fate_edge.fetch.fetch_engine import FetchEngine
    from fate_edge.fetch.transfer import Copier
    from fate_edge.format.store import ExpertStore
    from fate_edge.runtime.cache import ExpertCache
    from fate_edge.runtime.host_tier import HostTier
    from fate_edge.runtime.policy import PolicyConfig
    from fate_edge.runtime.scheduler_stats import SchedulerStats

Key = tuple[int, int]


class TierPath:
    host: HostTier | None
    cache: ExpertCache | None
    copier: Copier
    fetch: FetchEngine
    store: ExpertStore
    policy: PolicyConfig
    dtype: torch.dtype
    stats: SchedulerStats
    in_use: list[Key]
    prefetches: dict[Key, Any]
    land_early: bool
    stages_prompts: bool
    _prompt: bool
    _landed: dict[Key, int]
    _host_held: list[Key]
    _on_cpu: bool
    _prefill: bool
    config: Any
    miss_rule: MissRule
    _rows: dict[int, int]  # this layer call's rows per routed expert
    zero_copy: bool
    lends: bool
    # Portable int4 experts kept as their uploaded blobs, not decoded (runtime.portable_expert): the slot decode step's
    # in-place kernel reads them so (SlotGraphDecode(..., in_place=True) sets it). Not with zero-copy or lends.
    keeps_blobs = False

    def _take(self, f: Any) -> memoryview:  # Scheduler's
        raise NotImplementedError

    def _admit(self, key: Key, expert: object, nbytes: int, bits: int) -> bool:  # Scheduler's
        raise NotImplementedError

    def _count_use(self, layer: int, kind: int) -> None:  # Scheduler's
        raise NotImplementedError

    def _upload(
        self,
        key: Key,
        payload: memoryview,
        bits: int,
        demand: bool,
        release: Callable[[], object] | None = None,
        use_now: bool = True,
    ) -> tuple[Expert, bool]:
        """``payload`` copied to the device and decoded there, then offered to the cache (pinned for this layer where
        ``use_now``) → (the expert, whether cached). ``release``: gives the staging buffer back once the copy out of it
        has landed; None: the payload is ``key``'s host-tier slot, kept from reuse until then."""
        blob, event = self.copier.upload(payload, demand=demand)
        for nbytes, seconds in self.copier.timings():  # the link's speed, for the per-miss choice
            self.miss_rule.link_measured(nbytes, seconds)
        if release is not None:
            self.copier.release_after(event, release)
        elif self.host is not None:
            self.host.copying(key, event)
        precision = self.store.precisions[bits]
        if self.keeps_blobs and keeps_in_place(precision):
            expert: Any = PortableExpert(blob, precision)  # no re-pack: the blob is the expert's memory
        else:
            expert = decode_expert(blob, precision, self.dtype)
        # charged what it holds: a view in it keeps its whole base (the uploaded blob) alive
        held = max(expert.nbytes, held_bytes(expert))
        cached = self.cache is not None and bits == self.policy.bits and self._admit(key, expert, held, bits)
        if cached and use_now:
            assert self.cache is not None
            self.cache.pin(key)
            self.in_use.append(key)
        return expert, cached

    def _land(self) -> None:
        """Make ready the prefetches whose reads have landed (:attr:`land_early`): uploaded, decoded and cached now,
        a hit when their layer asks. Cold copies and failed reads wait for their use, as before."""
        if not self.land_early or (self.stages_prompts and self._prompt):  # staged prompts take the blobs
            return
        for key, f in [(k, f) for k, f in self.prefetches.items() if f.req.done.is_set()]:
            if f.bits != self.policy.bits or f.req.state != "done":
                continue
            del self.prefetches[key]
            t0 = time.perf_counter()
            payload = self._take(f)
            release = self._into_tier(key, f.req, payload, None)
            _, cached = self._upload(key, payload, f.bits, False, release, use_now=False)
            self.stats.consume_s += time.perf_counter() - t0
            self.stats.landed_early += 1
            if cached:
                self._landed[key] = f.req.ref.length
            else:  # the cache declined it: its use reads again (or copies from the host tier)
                self.stats.wasted_bytes += f.req.ref.length

    def _submit(self, key: Key, bits: int, priority: Priority) -> FetchRequest:
        """A store read of ``key``: straight into a host-tier slot where the tier admits it at the policy's precision
        (no staging buffer, no copy into the slot), else into a staging buffer of the pool."""
        ref = self.store.ref(*key, bits)
        # not where an expert is computed in its read buffer (zero-copy, lends: the CPU's, which has no host tier)
        host = self.host if bits == self.policy.bits and not (self.zero_copy or self.lends) else None
        into = host.reserve(key, ref.read_length, bits) if host is not None else None
        # `into` only when there is a slot: the plain call stays the fetch engine's two-argument one
        req = self.fetch.submit(ref, priority) if into is None else self.fetch.submit(ref, priority, into=into)
        if host is not None and into is not None and req.into is not into:  # joined a read under way: slot unused
            host.abandon(key, into)
        return req

    def _into_tier(
        self, key: Key, req: FetchRequest, payload: memoryview, info: AccessInfo | None
    ) -> Callable[[], object] | None:
        """A landed read (its CRC checked) offered to the host tier (a use, where ``info``): one read into its slot
        makes the slot valid now, another is copied into a slot if the tier admits it. Returns how the read's
        buffer goes back after its upload: a staging buffer once the copy out of it lands; None for a slot, kept from
        reuse by the copy's event instead (:meth:`_upload`)."""
        host = self.host if req.ref.bits == self.policy.bits else None
        if host is not None and info is not None:
            host.access(key, False, info)
        if host is not None and req.into is not None and host.fill(key, req.ref.length, req.into):
            self.fetch.release(req)  # nothing goes back to the pool; a prefetch's share is freed
            return None
        if host is not None:
            host.admit(key, payload, req.ref.bits)
        return partial(self.fetch.release, req)

    def _abandon(self, req: FetchRequest) -> None:
        """A read into a host-tier slot that was not used, and has stopped: a completed one (its CRC checked) leaves
        the slot holding its blob; a failed or cancelled one leaves the slot free again, never marked held."""
        if req.into is None or self.host is None:
            return
        key = (req.ref.layer, req.ref.expert)
        if not (req.state == "done" and self.host.fill(key, req.ref.length, req.into)):
            self.host.abandon(key, req.into)

    def _host_holds(self, key: Key) -> bool:
        """Whether the host tier holds ``key`` at the policy's precision: then pinned there till :meth:`end_layer`
        and served from it, with no store read."""
        if self.host is None or not self.host.holds(key, self.policy.bits):
            return False
        if key not in self._host_held:
            self.host.pin(key)
            self._host_held.append(key)
        return True

    def _from_host(self, key: Key, info: AccessInfo) -> Expert:
        """A device miss the host tier holds: computed on the CPU where it lies (policy ``miss_compute="hybrid"``, a
        decode row: runtime.cpu_miss), else copied to the device from its slot and cached."""
        assert self.host is not None
        t0 = time.perf_counter()
        if self.cache is not None:
            self.cache.access(key, False, info)
        self.host.access(key, True, info)
        self.host.stats.served += 1
        expert: Expert
        if self._on_cpu and self._place(key) == CPU:
            blob = torch.frombuffer(self.host.blob(key), dtype=torch.uint8)
            on_cpu = decode_expert(blob, self.store.precisions[self.policy.bits], self.dtype, "cpu")
            self.miss_rule.decode_measured(time.perf_counter() - t0)
            # called as any expert is (layer_step.expert_rows), its compute timed for the rule
            expert = cast(Expert, OnHost(on_cpu, self.miss_rule.cpu_measured))
            self.stats.cpu_computed += 1
        else:
            expert, _ = self._upload(key, self.host.blob(key), self.policy.bits, demand=True)
            self.stats.copied_up += int(self._on_cpu)
        self.stats.consume_s += time.perf_counter() - t0
        self.stats.misses += 1
        self.stats.host_hits += 1
        self._count_use(key[0], 2)
        return expert

    def _ready_from_host(self, key: Key, bits: int) -> None:
        """A prefetch the host tier holds: copied to the device and cached now (:attr:`land_early`), else left to
        be served from the host tier when its layer asks."""
        assert self.host is not None
        if self.land_early and bits == self.policy.bits:
            _, cached = self._upload(key, self.host.blob(key), bits, demand=False, use_now=False)
            self.stats.landed_early += 1
            if cached:
                self._landed[key] = 0

    def _place(self, key: Key) -> str:
        """Where a host-held miss runs under ``miss_compute="hybrid"`` (runtime.miss_rule): its rows in this layer
        call, its blob's bytes, one row's hidden state."""
        assert self.host is not None
        rows = self._rows.get(key[1], 1)
        hidden = self.config.hidden_size * self.dtype.itemsize
        return self.miss_rule.choose(key, rows, len(self.host.blob(key)), hidden, self._prefill)

    def _new_miss_rule(self) -> MissRule:
        """The per-miss rule, its copies' stay in the device cache from the cache's entries per MoE layer."""
        cfg, k = self.config, self.config.num_experts_per_tok
        entries = self.cache.capacity_bytes / self.store.precisions[self.policy.bits].blob_bytes if self.cache else 0
        return MissRule(top_k=k, num_experts=cfg.num_experts, horizon_tokens=entries / len(cfg.moe_layers) / k)

    def observe_routing(self, layer: int, ids: list[int], counts: list[int], prompt: bool) -> None:
        """This layer call's rows per expert, and a decode token's uses (the rule's popularity)."""
        self._rows = dict(zip(ids, counts))
        if self._on_cpu and not prompt:
            self.miss_rule.observe(layer, ids)

    def seed_misses(self, planned: Any) -> None:
        """Seed the per-miss rule with the planner's measured costs (``planning.planner.Plan.miss_costs``, where the
        device has a host link)."""
        costs = getattr(planned, "miss_costs", None)
        if costs is not None:
            self.miss_rule.seed(costs)
