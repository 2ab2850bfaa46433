"""The host tier: experts' blobs held in host memory between the store and the device cache (DESIGN §10, "Tiers on
a GPU": device slots ← host tier ← the store).

On a discrete GPU a device miss that the host tier holds is copied from host memory, with no read from the store.
The tier is one slab allocated once and cut into fixed slots of the store's read-buffer size, each holding one
expert's blob as the store wrote it (checked by the read that brought it). Where CUDA is present the slab is pinned
(registered with the driver, so the copy is an asynchronous DMA and nothing is rounded up; torch's pinned allocator
rounds every block to a power of two), else it is plain memory. Which experts it keeps follows the run's own
eviction policy over one pool (``cache.factory.build_cache`` with a global partition): the same admissions and
evictions, popularity seeds included, as the device cache makes.

A slot whose blob is still being copied to the device (its event not complete) is never overwritten: an eviction
that would reuse it waits for that copy first. On one memory (a CPU, a Jetson) there is no host tier: the device
cache already lies in host DRAM (runtime.memory_tiers).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from fate_edge.runtime.cache import AccessInfo, ExpertCache
from fate_edge.runtime.cache.factory import build_cache
from fate_edge.runtime.held_bytes import pinned_held_bytes
from fate_edge.runtime.policy import PolicyConfig

_log = logging.getLogger(__name__)
Key = tuple[int, int]


@dataclass
class HostTierStats:
    admitted: int = 0  # blobs copied into a slot
    refused: int = 0  # blobs the policy declined (or no slot free of pins)
    served: int = 0  # device misses served from a slot (no store read)


class HostTier:
    def __init__(
        self,
        capacity_bytes: int,
        slot_bytes: int,
        policy: PolicyConfig,
        moe_layers: list[int],
        num_experts: int,
        pinned: bool = False,
        popularity: dict[int, list[int]] | None = None,
        top_k: int = 2,
        future: list | None = None,
    ):
        """``capacity_bytes`` of host memory in slots of ``slot_bytes`` (the store's read buffer at the policy's
        precision); ``pinned``: register the slab with the CUDA driver (where CUDA is present)."""
        slots = capacity_bytes // slot_bytes if slot_bytes > 0 else 0
        if slots < 1:
            raise ValueError(f"a host tier of {capacity_bytes} bytes holds no expert of {slot_bytes} bytes")
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.slab, self.held_bytes, self.registered = _slab(slots * slot_bytes, pinned)
        # a registered slab is handed back to the driver before its memory is freed, closed or not (it holds the slab)
        self._unregister = weakref.finalize(self, _unregister, self.slab) if self.registered else None
        self._view = self.slab.numpy().data.cast("B")
        self._free = list(range(slots - 1, -1, -1))
        self._where: dict[Key, tuple[int, int, int]] = {}  # key → (slot, blob length, bits)
        self._copying: dict[int, Any] = {}  # slot → event of a copy out of it that may still be in flight
        one_pool = policy.with_(cache=True, allocation="global", resident_first=False, preload=False)
        cache = build_cache(
            one_pool, slots * slot_bytes, slot_bytes, moe_layers, num_experts, future, popularity, None, top_k
        )
        assert cache is not None  # cache=True
        self.cache: ExpertCache = cache
        self.cache.on_evict = self._evicted
        self.stats = HostTierStats()

    def __contains__(self, key: Key) -> bool:
        return key in self._where

    def __len__(self) -> int:
        return len(self._where)

    def holds(self, key: Key, bits: int) -> bool:
        where = self._where.get(key)
        return where is not None and where[2] == bits

    def blob(self, key: Key) -> memoryview:
        """The blob of ``key`` in its slot (valid while ``key`` is held; pin it across a use)."""
        slot, length, _ = self._where[key]
        return self._view[slot * self.slot_bytes : slot * self.slot_bytes + length]

    def admit(self, key: Key, payload: memoryview, bits: int) -> bool:
        """Copy ``payload`` (a checked blob) into a slot if the policy admits ``key`` (evicting as it says)."""
        if key in self._where:
            return True
        if len(payload) > self.slot_bytes or not self.cache.insert(key, None, self.slot_bytes, bits):
            self.stats.refused += 1
            return False
        slot = self._free.pop()  # an insert within capacity leaves a slot free (each entry takes one)
        event = self._copying.pop(slot, None)
        if event is not None:  # the slot's last blob may still be on its way to the device
            event.synchronize()
        start = slot * self.slot_bytes
        self._view[start : start + len(payload)] = payload
        self._where[key] = (slot, len(payload), bits)
        self.stats.admitted += 1
        return True

    def copying(self, key: Key, event: Any) -> None:
        """A copy out of ``key``'s slot is in flight until ``event`` completes (None: it has completed)."""
        if event is not None and key in self._where:
            self._copying[self._where[key][0]] = event

    def access(self, key: Key, hit: bool, info: AccessInfo) -> None:
        self.cache.access(key, hit, info)

    def pin(self, key: Key) -> None:
        self.cache.pin(key)

    def unpin(self, key: Key) -> None:
        self.cache.unpin(key)

    def _evicted(self, key: Key) -> None:
        slot, _, _ = self._where.pop(key)
        self._free.append(slot)

    def close(self) -> None:
        """Forget every blob and hand the slab's registration back to the driver."""
        self.cache.clear()
        for event in self._copying.values():
            event.synchronize()
        self._copying.clear()
        if self._unregister is not None:
            self._unregister()


def _unregister(slab: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(slab.data_ptr())


def _slab(nbytes: int, pinned: bool) -> tuple[torch.Tensor, int, bool]:
    """(the slab, the bytes it holds, whether it is registered with the driver). Pinned: registered in place
    (``cudaHostRegister``: exactly ``nbytes``), else through torch's pinned allocator (rounded up to a power of two,
    charged so); not pinned: plain memory."""
    slab = torch.empty(nbytes, dtype=torch.uint8)
    if not pinned:
        return slab, nbytes, False
    try:
        err = torch.cuda.cudart().cudaHostRegister(slab.data_ptr(), nbytes, 0)
        if int(err) == 0:
            return slab, nbytes, True
        _log.info("cudaHostRegister of the host tier failed (%s): torch's pinned allocator instead", err)
    except (AttributeError, RuntimeError) as e:
        _log.info("cudaHostRegister is not available (%s): torch's pinned allocator instead", e)
    del slab
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), pinned_held_bytes(nbytes), False


def tier_held(tier: HostTier | None) -> int:
    """Bytes a host tier holds (its slab as allocated), charged to the host budget; 0 for none."""
    return tier.held_bytes if tier is not None else 0


def host_tier_bytes(requested: int | str, unified: bool, all_experts: int, free: int) -> int:
    """Bytes for the host tier: none on one memory (the device cache already lies in host DRAM: the two budgets
    are one, runtime.memory_tiers); ``"auto"``: every expert's blob (``all_experts``) where half of the ``free``
    host memory holds them, else that half; else the size asked."""
    from fate_edge.runtime.budget import parse_bytes

    if unified:
        return 0
    if requested == "auto":
        return max(0, min(all_experts, free // 2))
    return parse_bytes(requested)


def open_host_tier(requested: int | str, engine: Any) -> HostTier | None:
    """The host tier of an :class:`~fate_edge.runtime.engine.Engine` that has planned its budget (None where it has
    none: one memory, a size of 0, or too little free memory for one expert)."""
    from fate_edge.errors import BudgetError
    from fate_edge.runtime.memory_account import available_memory_bytes
    from fate_edge.sizes import format_bytes

    cfg, policy = engine.model.config, engine.policy
    slot = engine.store.precisions[policy.bits].slot_bytes
    all_experts = len(cfg.moe_layers) * cfg.num_experts * slot
    free = available_memory_bytes() - engine.plan.host_bytes
    nbytes = host_tier_bytes(requested, engine._unified, all_experts, free)
    if nbytes == 0 or (requested == "auto" and nbytes < slot):
        return None
    if nbytes < slot:
        raise BudgetError(f"a host tier of {nbytes} bytes holds no expert of {slot} bytes; give at least {slot} or 0")
    if nbytes > free:
        raise BudgetError(
            f"a host tier of {format_bytes(nbytes)} does not fit the {format_bytes(max(0, free))} of host memory "
            "available; lower host_memory or free memory"
        )
    future = engine.trace.calls if engine.trace is not None else None
    return HostTier(
        min(nbytes, all_experts),
        slot,
        policy,
        list(cfg.moe_layers),
        cfg.num_experts,
        pinned=engine.device.startswith("cuda"),
        popularity=engine.popularity,
        top_k=cfg.num_experts_per_tok,
        future=future,
    )
