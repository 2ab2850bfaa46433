"""The host tier: experts' blobs held in host memory between the store and the device cache (DESIGN §10, "Tiers on
a GPU": device slots ← host tier ← the store).

On a discrete GPU a device miss that the host tier holds is copied from host memory, with no read from the store.
The tier is one slab allocated once and cut into fixed slots of the store's read-buffer size, each holding one
expert's blob as the store wrote it (checked by the read that brought it). Where CUDA is present the slab is pinned
(registered with the driver, so the copy is an asynchronous DMA and nothing is rounded up; torch's pinned allocator
rounds every block to a power of two), else it is plain memory. Which experts it keeps follows the run's own
eviction policy over one pool (``cache.factory.build_cache`` with a global partition): the same admissions and
evictions, popularity seeds included, as the device cache makes.

A store read the tier admits is read straight into its slot (:meth:`HostTier.reserve`: the fetch engine reads into
the slot's memory, no staging buffer and no copy into the slot). The slot is taken at the read's submission and held
(pinned, not yet valid) until the read lands: :meth:`HostTier.fill` marks it valid once the read's CRC has been
checked; a failed, corrupt or dropped read gives it back (:meth:`HostTier.abandon`), never marked held. Where the slab's
slots cannot take a direct read (slot size not a multiple of the O_DIRECT alignment) a read lands in a staging buffer
and is copied into its slot (:meth:`HostTier.admit`).

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

from fate_edge.format.blob import ALIGN
from fate_edge.runtime.cache import AccessInfo, ExpertCache
from fate_edge.runtime.cache.factory import build_cache
from fate_edge.runtime.held_bytes import pinned_held_bytes
from fate_edge.runtime.policy import PolicyConfig

_log = logging.getLogger(__name__)
Key = tuple[int, int]


@dataclass
class HostTierStats:
    admitted: int = 0  # blobs that took a slot
    read_into: int = 0  # ... read from the store straight into their slot
    staged: int = 0  # ... copied into their slot from a staging buffer
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
        # slots a read can land in directly (O_DIRECT: aligned addresses and lengths)
        self.direct = slot_bytes % ALIGN == 0
        self.slab, self.held_bytes, self.registered = _slab(slots * slot_bytes, pinned, ALIGN if self.direct else 1)
        # a registered slab is handed back to the driver before its memory is freed, closed or not (it holds the slab)
        self._unregister = weakref.finalize(self, _unregister, self.slab) if self.registered else None
        self._view = self.slab.numpy().data.cast("B")
        self._free = list(range(slots - 1, -1, -1))
        self._where: dict[Key, tuple[int, int, int]] = {}  # key → (slot, blob length, bits)
        # key → (slot, bits, the slot's memory): a read into the slot is under way
        self._reserved: dict[Key, tuple[int, int, memoryview]] = {}
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
        if key in self._reserved:  # its own read is landing in a slot
            return False
        slot = self._take_slot(key, len(payload), bits)
        if slot is None:
            return False
        start = slot * self.slot_bytes
        self._view[start : start + len(payload)] = payload
        self._where[key] = (slot, len(payload), bits)
        self.stats.admitted += 1
        self.stats.staged += 1
        return True

    def reserve(self, key: Key, nbytes: int, bits: int) -> memoryview | None:
        """A slot for a store read of ``key`` (``nbytes`` read, alignment padding included) to land in, if the policy
        admits it (evicting as it says); held, not valid, until :meth:`fill` or :meth:`abandon`. None: not admitted,
        already held or under way, or the slots take no direct read."""
        if not self.direct or key in self._where or key in self._reserved:
            return None
        slot = self._take_slot(key, nbytes, bits)
        if slot is None:
            return None
        self.cache.pin(key)  # not evicted while the read may still write into it
        view = self._view[slot * self.slot_bytes : (slot + 1) * self.slot_bytes]
        self._reserved[key] = (slot, bits, view)
        return view

    def _reserved_for(self, key: Key, view: memoryview) -> bool:
        r = self._reserved.get(key)
        return r is not None and r[2] is view

    def fill(self, key: Key, length: int, view: memoryview) -> bool:
        """The read into ``view``, ``key``'s reserved slot, has landed, its CRC checked: the slot holds its blob
        now. False where ``view`` is not ``key``'s reservation."""
        if not self._reserved_for(key, view):
            return False
        slot, bits, _ = self._reserved.pop(key)
        self._where[key] = (slot, length, bits)
        self.cache.unpin(key)
        self.stats.admitted += 1
        self.stats.read_into += 1
        return True

    def abandon(self, key: Key, view: memoryview) -> None:
        """The read into ``view``, ``key``'s reserved slot, failed or was dropped (and has stopped): the slot is
        free again, never marked held."""
        if self._reserved_for(key, view):
            self.cache.unpin(key)
            self.cache.discard(key)  # on_evict frees the slot

    def _take_slot(self, key: Key, nbytes: int, bits: int) -> int | None:
        """A free slot for ``key`` if the policy admits it (evicting as it says), its last copy out landed."""
        if nbytes > self.slot_bytes or not self.cache.insert(key, None, self.slot_bytes, bits):
            self.stats.refused += 1
            return None
        slot = self._free.pop()  # an insert within capacity leaves a slot free (each entry takes one)
        event = self._copying.pop(slot, None)
        if event is not None:  # the slot's last blob may still be on its way to the device
            event.synchronize()
        return slot

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
        where = self._where.pop(key, None)
        self._free.append(where[0] if where is not None else self._reserved.pop(key)[0])

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


def _slab(nbytes: int, pinned: bool, align: int = 1) -> tuple[torch.Tensor, int, bool]:
    """(the slab, the bytes it holds, whether it is registered with the driver), starting at a multiple of
    ``align`` (what O_DIRECT reads into). Pinned: registered in place (``cudaHostRegister``: exactly its bytes), else
    through torch's pinned allocator (page-aligned; rounded up to a power of two, charged so); not pinned: plain
    memory."""
    whole = torch.empty(nbytes + align - 1, dtype=torch.uint8)
    skip = (-whole.data_ptr()) % align
    slab = whole[skip : skip + nbytes]  # a view: its storage (what is held) is the whole allocation
    if not pinned:
        return slab, whole.numel(), False
    try:
        err = torch.cuda.cudart().cudaHostRegister(slab.data_ptr(), nbytes, 0)
        if int(err) == 0:
            return slab, whole.numel(), True
        _log.info("cudaHostRegister of the host tier failed (%s): torch's pinned allocator instead", err)
    except (AttributeError, RuntimeError) as e:
        _log.info("cudaHostRegister is not available (%s): torch's pinned allocator instead", e)
    del slab, whole
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
