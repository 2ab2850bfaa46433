"""The KV caches of a batch as ranges of one buffer per layer, so a batched decode step attends in one operator.

Each sequence still has its own :class:`~fate_edge.model.kv_cache.KVCache`: its layer caches are views of a
contiguous range of the slab (its prompt plus answer, reserved at admission), appended to as any cache is. Because
every range lives in the same [1, kv heads, positions, d] tensor, one step's decode tokens write their keys and
values with one ``index_copy_`` and attend with one masked ``scaled_dot_product_attention`` per layer
(``batch_step``), instead of an append and an attention per sequence. An MLA model's slab holds its latent and
rope key the same way (its sequences append and attend one by one).

The slab is the batch's KV budget: a range that does not fit waits for one to be released. It starts zeroed and
ranges are never left holding NaN, so masked-out keys weigh exactly zero.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fate_edge.model.kv_cache import KVCache

if TYPE_CHECKING:
    from fate_edge.model.transformer import MoETransformer


class SlabCache(KVCache):
    """A sequence's KV cache held in ``slab`` at positions [offset, offset + capacity)."""

    def __init__(self, slab: KVSlab, offset: int, capacity: int):
        super().__init__(len(slab.buffers), capacity_hint=capacity)
        self.slab, self.offset, self.capacity = slab, offset, capacity
        for layer, held in zip(self.layers, slab.buffers):
            layer.buffers = [b[:, :, offset : offset + capacity] for b in held]


class KVSlab:
    """``positions`` KV positions per layer for all the sequences of a batch together, handed out as ranges."""

    def __init__(self, model: MoETransformer, positions: int):
        cfg = model.config
        if positions < 1:
            raise ValueError(f"a KV slab needs at least one position, got {positions}")
        self.positions = positions
        if cfg.mla is None:  # keys and values [1, kv heads, positions, head dim]
            shapes = [(1, cfg.num_key_value_heads, positions, cfg.head_dim)] * 2
        else:  # MLA's cache: the latent and the rope key side by side, one "head"
            shapes = [(1, 1, positions, cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim)]
        # per layer, what a LayerCache holds (kv_cache.LayerCache.buffers): keys and values, or MLA's latent
        self.buffers = [
            [torch.zeros(shape, dtype=model.dtype, device=model.device) for shape in shapes]
            for _ in range(cfg.num_hidden_layers)
        ]
        self._free: list[tuple[int, int]] = [(0, positions)]  # (start, length), by start

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for held in self.buffers for t in held)

    @property
    def free_positions(self) -> int:
        return sum(n for _, n in self._free)

    def allocate(self, capacity: int) -> SlabCache | None:
        """A cache of ``capacity`` positions in the lowest free range that holds it, or None while none does."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        for i, (start, n) in enumerate(self._free):
            if n >= capacity:
                if n == capacity:
                    del self._free[i]
                else:
                    self._free[i] = (start + capacity, n - capacity)
                return SlabCache(self, start, capacity)
        return None

    def release(self, cache: SlabCache) -> None:
        """Give ``cache``'s range back (zeroed, so stale keys never reach a later sequence), merging neighbours."""
        a, n = cache.offset, cache.capacity
        for held in self.buffers:
            for b in held:
                b[:, :, a : a + n].zero_()
        for layer in cache.layers:
            layer.buffers, layer.length = [], 0
        merged = sorted([*self._free, (a, n)])
        self._free = []
        for start, length in merged:
            if self._free and self._free[-1][0] + self._free[-1][1] == start:
                self._free[-1] = (self._free[-1][0], self._free[-1][1] + length)
            else:
                self._free.append((start, length))
