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

from collections import Counter
from typing import TYPE_CHECKING

import torch

from fate_edge.errors import BudgetError
from fate_edge.model.grouped_prefill import GroupedPrefill
from fate_edge.quant.triton_moe import Int4MoELayout
from fate_edge.runtime.scheduler import Scheduler
from fate_edge.sizes import format_bytes

if TYPE_CHECKING:
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
        for e, payload, source in self.sched.layer_blobs(layer, ids, on_read=self._read):
            self.sources[source] += 1
            blob = torch.frombuffer(payload, dtype=torch.uint8)
            slab[base + e, : blob.numel()].copy_(blob)
            self.staged_bytes += blob.numel()
        self.ahead[layer] = sum(key[0] > layer for key in self.sched.prefetches)
        self.grouped.slot_of[layer] = self._regions[region]
        self.calls += 1
        return self.grouped(layer, h, idx, weights, acc)

    def _read(self, key: tuple[int, int]) -> None:
        self.reads[key] += 1


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
    if engine.cache is not None and not engine.cache.shrink(need):
        raise BudgetError("grouped prefill's staging cannot be taken from the cache: its experts are in use")
    plan.cache_bytes = max(0, plan.cache_bytes - need)
    plan.prefill_staging_bytes += need
    engine.scheduler.stages_prompts = True  # a prompt's reads ahead stay blobs for the staging (not uploaded)
    engine.model.grouped_prefill = server
    return server
