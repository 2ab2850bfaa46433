"""Grouped prefill at a budget: a prompt's MoE layer from the portable int4 blobs of the experts its tokens route to,
gathered into a bounded staging area, while the reads of the layers ahead travel (docs/gpu.md, "Grouped prefill").

The scheduler (``runtime.scheduler``) still observes each prompt layer's routing: it issues demand reads for the
layer's experts that nothing holds and, through the policy's cross-layer predictor, reads ahead for the next layers,
all before the layer computes. :class:`StagedGroupedPrefill` then takes the layer's union of experts as blobs, not as
decoded experts, from where the run holds them: a read ahead or a demand read in flight (its buffer back to the pool
once copied), the host tier, a cached expert whose read buffer is its memory (the CPU's zero-copy cache), else a
demand read now (the fetch engine checks every read's CRC). They are copied into one of ``slots`` layer-sized
regions (expert ``e`` of a layer in slot ``e`` of its region, as ``runtime.grouped_prefill`` lays a whole model
out), and the layer runs as ``model.grouped_prefill.GroupedPrefill``'s grouped call over that region. The regions
are charged to the expert budget: :func:`use_budgeted_grouped_prefill` takes their bytes from the cache's share
(``BudgetPlan.prefill_staging_bytes``) and refuses, naming the budget needed, where that share cannot hold them.

The blobs a prompt reads are not decoded into the device cache (decode starts with the cache the prompt found, plus
the host tier's admissions); during a prompt the scheduler makes no read ahead ready as it lands (``land_early``, a
GPU's upload into its cache), so that the staging takes its blob. Checked on the CPU under Triton's interpreter, not
measured on a GPU.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from fate_edge.errors import BudgetError
from fate_edge.fetch.fetch_engine import Priority
from fate_edge.model.grouped_prefill import GroupedPrefill
from fate_edge.quant.triton_moe import Int4MoELayout
from fate_edge.runtime.scheduler import Scheduler, _Fetch
from fate_edge.sizes import format_bytes

if TYPE_CHECKING:
    from fate_edge.runtime.cache import ExpertCache
    from fate_edge.runtime.engine import Engine


class StagedGroupedPrefill:
    """A prompt's MoE layers served by grouped calls over ``slots`` staging regions filled from ``scheduler``'s
    sources (a ``model.grouped_prefill`` server: set as ``model.grouped_prefill``)."""

    def __init__(self, scheduler: Scheduler, device: str | torch.device = "cpu", slots: int = 2, block_m: int = 16):
        if slots < 1:
            raise ValueError(f"grouped prefill at a budget needs at least one staging slot, got {slots}")
        self.sched = scheduler
        precision = scheduler.store.precisions.get(scheduler.policy.bits)
        if precision is None or scheduler.policy.bits != 4:
            raise ValueError(
                f"grouped prefill reads int4 experts; policy '{scheduler.policy.name}' reads "
                f"int{scheduler.policy.bits}: use a policy with bits=4 on a portable int4 store"
            )
        self.layout = Int4MoELayout.of(precision)  # refuses another layout (before allocating), naming the fix
        n = scheduler.config.num_experts
        self.slots, self.n = slots, n
        slab = torch.zeros(slots * n, self.layout.slot_bytes, dtype=torch.uint8, device=device)
        self.grouped = GroupedPrefill(slab, {}, precision, block_m)
        self._regions = [torch.arange(r * n, (r + 1) * n, device=device) for r in range(slots)]
        self._next = 0
        self.calls = 0  # layers served
        self.staged_bytes = 0  # blob bytes copied into the regions (all prompts)
        self.sources: Counter[str] = Counter()  # where each staged blob came from
        self.reads: Counter[tuple[int, int]] = Counter()  # (layer, expert) → store reads this server submitted
        # MoE layer → reads of later layers in flight or landed when its grouped compute started (the pipeline)
        self.ahead: dict[int, int] = {}

    @property
    def nbytes(self) -> int:
        """The staging regions' bytes: what the budget is charged."""
        return self.grouped.slab.numel()

    def __call__(
        self, layer: int, h: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, acc: torch.Tensor | None
    ) -> torch.Tensor:
        """``GroupedPrefill``'s call, its experts first staged in the next region."""
        region, self._next = self._next, (self._next + 1) % self.slots
        base = region * self.n
        slab = self.grouped.slab
        ids = idx.unique().tolist()  # the host picks the blobs: on a GPU a sync, as the observers' routing copy is
        for e, payload in self._blobs(layer, ids):
            blob = torch.frombuffer(payload, dtype=torch.uint8)
            slab[base + e, : blob.numel()].copy_(blob)
            self.staged_bytes += blob.numel()
        self.ahead[layer] = sum(key[0] > layer for key in self.sched.prefetches)
        self.grouped.slot_of[layer] = self._regions[region]
        self.calls += 1
        return self.grouped(layer, h, idx, weights, acc)

    def _blobs(self, layer: int, ids: list[int]) -> Iterator[tuple[int, memoryview]]:
        """(expert, its checked blob) for each of ``ids``: held ones first, then reads in the order they land; each
        read's buffer back to the pool once its blob is copied (when the caller asks for the next)."""
        s, bits = self.sched, self.sched.policy.bits
        pending: dict[int, _Fetch] = {}
        for e in ids:
            key = (layer, e)
            f = s.prefetches.pop(key, None) or s.demands.pop(key, None)
            if f is not None and f.bits != bits:  # a cold copy read ahead: the prompt reads the policy's precision
                s._drop(f)
                f = None
            if f is not None:
                pending[e] = f
            elif s.host is not None and s.host.holds(key, bits):
                self._count("host", layer, hit=True)
                yield e, s.host.blob(key)  # copied before the next blob: nothing can evict it meanwhile
            elif key in s._kept:  # the CPU's zero-copy cache: the cached expert's memory is its read buffer
                self._count("cache", layer, hit=True)
                yield e, s._kept[key].view[: s.store.ref(layer, e, bits).length]
            else:  # nothing holds its blob (or the cache holds it decoded): read it now
                self.reads[key] += 1
                pending[e] = _Fetch(s._submit(key, bits, Priority.DEMAND), bits, False)  # into a tier slot if admitted
        s._issue_deferred()  # this layer's reads ahead left the scheduler's table: room for the layers ahead
        try:
            while pending:
                ready = [e for e, f in pending.items() if f.req.done.is_set()]
                if not ready:
                    t0 = time.perf_counter()
                    with s.fetch.completed:
                        if not any(f.req.done.is_set() for f in pending.values()):
                            s.fetch.completed.wait(timeout=0.05)
                    s.stats.stall_s += time.perf_counter() - t0
                    continue
                for e in ready:
                    f = pending.pop(e)
                    try:
                        payload = s._take(f)
                        s._into_tier((layer, e), f.req, payload, None)  # kept in host memory: no store read next
                        self._count("prefetched" if f.prefetched else "demand", layer, nbytes=f.req.ref.length)
                        yield e, payload
                    finally:
                        s.fetch.release(f.req)
        except BaseException:  # a failed read, or the request abandoned mid-layer: every buffer back
            for f in pending.values():
                s._drop(f, wasted=False)
            raise

    def _count(self, source: str, layer: int, hit: bool = False, nbytes: int = 0) -> None:
        """The staged blob's source, in the scheduler's statistics too (hits, prefetch hits, misses)."""
        s = self.sched
        self.sources[source] += 1
        if hit:
            s.stats.hits += 1
            s._count_use(layer, 0)
        elif source == "prefetched":
            s._prefetch_used(layer, nbytes)
        else:
            s.stats.misses += 1
            s.stats.demand_bytes += nbytes
            s._count_use(layer, 2)


def use_budgeted_grouped_prefill(engine: Engine, slots: int = 2, block_m: int = 16) -> StagedGroupedPrefill:
    """Serve ``engine``'s prompts with grouped calls at its expert budget: ``slots`` layer-sized staging regions
    taken from the cache's share of the budget (the cache shrinks by as much, evicting where it must) → the server.
    Refuses, naming the budget needed, where the budget's room beyond the read buffers cannot hold them."""
    cfg, plan = engine.model.config, engine.plan
    if engine.model.grouped_prefill is not None:
        raise ValueError("this engine's prompts are grouped already (use_budgeted_grouped_prefill was called once)")
    layout = Int4MoELayout.of(engine.store.precisions[4]) if 4 in engine.store.precisions else None
    if layout is None:
        raise ValueError(f"{engine.store.path} has no int4 experts: convert with --bits 4 --layout portable")
    need = slots * cfg.num_experts * layout.slot_bytes
    room = plan.budget - plan.minimum - plan.prefill_staging_bytes
    if need > room:
        raise BudgetError(
            f"grouped prefill at a budget stages {slots} layers of {cfg.num_experts} experts "
            f"({format_bytes(need, round_up=True)}) but the memory budget leaves {format_bytes(room)} beyond its read "
            f"buffers; raise --memory-budget to at least {format_bytes(plan.budget + need - room, round_up=True)} "
            "or serve prompts without grouped prefill"
        )
    server = StagedGroupedPrefill(engine.scheduler, engine.model.device, slots, block_m)
    if engine.cache is not None:
        shrink_cache(engine.cache, need)
    plan.cache_bytes = max(0, plan.cache_bytes - need)
    plan.prefill_staging_bytes += need
    engine.scheduler.stages_prompts = True  # a prompt's reads ahead stay blobs for the staging (not uploaded)
    engine.model.grouped_prefill = server
    return server


def shrink_cache(cache: ExpertCache, nbytes: int) -> None:
    """Take ``nbytes`` of ``cache``'s capacity, from each partition in proportion to its share, evicting its least
    wanted unpinned entries (the partition's own policy picks them) until it fits. Each policy keeps the entry count
    it was built with as its size hint."""
    total = cache.capacity_bytes
    if nbytes <= 0 or total <= 0:
        return
    take = {p: min(cap, -(-nbytes * cap // total)) for p, cap in cache.capacity.items()}
    for p, cut in take.items():
        cache.capacity[p] -= cut
        while cache.used[p] > cache.capacity[p]:
            members = [k for k in cache._members[p] if cache.entries[k].pins == 0]
            if not members:
                raise BudgetError("grouped prefill's staging cannot be taken from the cache: its experts are in use")
            cache._evict(cache.policies[p].victim(members, incoming=None))
