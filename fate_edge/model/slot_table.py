"""Fixed expert slots and a (layer, expert) → slot table that a captured graph can index.

For one CUDA graph per token under a budget, the cache's memory is a slab of fixed slots (one expert blob each,
as the store holds it) and a table [MoE layers, experts] of int32 slot numbers (-1: not cached). Inside the graph
the router's ids index the table (``table[layer, ids]``: an index op, no host sync) and the kernel reads the
experts in their slots in place (``quant/triton_moe.py`` takes slots). Admissions and evictions are decided on the
host by the cache's policies between tokens; the table's changes are kept on the host and land on the device
table in one copy (:meth:`SlotTable.commit`), so the graph sees one consistent table per token.

A pure data structure: the slots' bytes (the slab) and the copies into them are the caller's.
"""

from __future__ import annotations

from typing import Any

import torch

from fate_edge.errors import BudgetError

Key = tuple[int, int]


class SlotTable:
    """``slots`` fixed slots for the experts of ``moe_layers`` × ``num_experts``; the table on ``device``."""

    def __init__(self, slots: int, moe_layers: list[int], num_experts: int, device: str | torch.device = "cpu"):
        if slots < 1:
            raise BudgetError("a slot table needs at least one slot: raise the expert budget")
        self.slots = slots
        self.rows = {layer: i for i, layer in enumerate(moe_layers)}
        self.num_experts = num_experts
        self._host = torch.full((len(moe_layers), num_experts), -1, dtype=torch.int32)
        self.table = self._host.to(device, copy=True)  # what the graph reads: changed only by commit()
        self._free = list(range(slots - 1, -1, -1))  # pop() hands out the lowest free slot
        self._slot_of: dict[Key, int] = {}
        self.dirty = False  # host changes not yet committed to the device table

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, key: Key) -> bool:
        return key in self._slot_of

    @property
    def free(self) -> int:
        return len(self._free)

    def slot(self, key: Key) -> int | None:
        return self._slot_of.get(key)

    def admit(self, key: Key) -> int:
        """A slot for ``key`` (its own if it has one); the caller evicts first when none is free."""
        if key in self._slot_of:
            return self._slot_of[key]
        layer, expert = key
        if layer not in self.rows or not 0 <= expert < self.num_experts:
            raise KeyError(f"expert {expert} of layer {layer} is not in this table")
        if not self._free:
            raise BudgetError(f"all {self.slots} expert slots are taken: evict one before admitting {key}")
        slot = self._slot_of[key] = self._free.pop()
        self._host[self.rows[layer], expert] = slot
        self.dirty = True
        return slot

    def release(self, key: Key) -> int | None:
        """Free ``key``'s slot (evicted); returns it, or None if it held none."""
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._host[self.rows[key[0]], key[1]] = -1
            self._free.append(slot)
            self._free.sort(reverse=True)
            self.dirty = True
        return slot

    def commit(self) -> None:
        """Apply the admissions and evictions since the last commit to the device table, in one copy (between
        tokens: the graph reads one consistent table per token)."""
        if self.dirty:
            self.table.copy_(self._host, non_blocking=self.table.device.type == "cuda")
            self.dirty = False

    def lookup(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """Slots of ``ids`` (experts of ``layer``) in the committed table, -1 for a miss: an index op on the table's
        device, capturable in a graph."""
        return self.table[self.rows[layer]].index_select(0, ids.reshape(-1).to(self.table.device)).view(ids.shape)

    def attach(self, cache: Any) -> None:
        """Free a key's slot whenever ``cache`` (an ExpertCache) evicts it, after any hook it had."""
        before = cache.on_evict

        def on_evict(key: Key) -> None:
            if before is not None:
                before(key)
            self.release(key)

        cache.on_evict = on_evict
