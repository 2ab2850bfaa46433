"""The KV caches of a batch as ranges of one buffer per layer, so a batched decode step attends in one operator.

Each sequence still has its own :class:`~fate_edge.model.kv_cache.KVCache`: its layer caches are views of a
contiguous range of the slab (its prompt plus answer, reserved at admission), appended to as any cache is. Because
every range lives in the same [1, kv heads, positions, d] tensor, one step's decode tokens write their keys and
values with one ``index_copy_`` and attend with one masked ``scaled_dot_product_attention`` per layer
(:class:`SlabRows`, a kind of ``kv_cache.AttentionState``), instead of an append and an attention per sequence.
An MLA model's slab holds its latent and rope key the same way.

The slab is the batch's KV budget: a range that does not fit waits for one to be released. It starts zeroed and
ranges are never left holding NaN, so masked-out keys weigh exactly zero.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from fate_edge.model.kv_cache import AttentionState, Held, KVCache, LayerCache, window_layers
from fate_edge.model.recurrent import recurrent_specs

if TYPE_CHECKING:
    from fate_edge.model.transformer import MoETransformer


class SlabCache(KVCache):
    """A sequence's KV cache held in ``slab`` at positions [offset, offset + capacity)."""

    def __init__(self, slab: KVSlab, offset: int, capacity: int):
        super().__init__(len(slab.buffers), capacity, slab.recurrent, slab.windows)
        self.slab = slab
        self.place(offset, capacity)

    def place(self, offset: int, capacity: int) -> None:
        """Hold positions [offset, offset + capacity) of the slab (the layers' buffers are views of them)."""
        self.offset, self.capacity = offset, capacity
        for layer, held in zip(self.layers, self.slab.buffers):
            if held:  # a recurrent state or a sliding window's end is the sequence's own, not in the slab
                assert isinstance(layer, LayerCache)
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
        # per layer, what a LayerCache holds (kv_cache.LayerCache.buffers): keys and values, or MLA's latent; none
        # for a recurrent layer (its state, a fixed size, is each sequence's own: kv_cache.RecurrentLayer) or a
        # sliding-window one (the end of the sequence it keeps, a fixed size too: kv_cache.window_positions). Never
        # inference tensors, even when made under inference mode (a prompt scored first: server.logprobs): the
        # batcher zeroes released ranges outside it, which torch refuses on an inference tensor.
        self.recurrent = recurrent_specs(cfg)
        self.windows = window_layers(cfg)
        with torch.inference_mode(False):
            self.buffers = [
                []
                if i in self.recurrent or i in self.windows
                else [torch.zeros(shape, dtype=model.dtype, device=model.device) for shape in shapes]
                for i in range(cfg.num_hidden_layers)
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

    def grow(self, cache: SlabCache, capacity: int) -> bool:
        """``cache`` holding ``capacity`` positions: extended in place where the range after it is free, else moved
        (its keys copied) to the lowest free range that holds it. False, and ``cache`` unchanged, while neither fits.
        A request's answer grows its range as it is written, so an answer of unknown length reserves no more than
        it has written (plus a step) and sequences share the slab as they need it."""
        extra = capacity - cache.capacity
        if extra <= 0:
            return True
        end = cache.offset + cache.capacity
        for i, (start, n) in enumerate(self._free):
            if start == end and n >= extra:  # the range right after it is free: take what it needs
                self._free[i : i + 1] = [(start + extra, n - extra)] if n > extra else []
                cache.place(cache.offset, capacity)
                return True
        moved = self.allocate(capacity)
        if moved is None:
            return False
        length = cache.length
        for held in self.buffers:
            for b in held:
                b[:, :, moved.offset : moved.offset + length] = b[:, :, cache.offset : cache.offset + length]
        old = (cache.offset, cache.capacity)
        cache.place(moved.offset, capacity)
        self._give_back(*old)
        return True

    def release(self, cache: SlabCache) -> None:
        """Give ``cache``'s range back (zeroed, so stale keys never reach a later sequence), merging neighbours."""
        for layer in cache.layers:
            layer.clear()
        self._give_back(cache.offset, cache.capacity)

    def _give_back(self, a: int, n: int) -> None:
        for held in self.buffers:
            for b in held:
                b[:, :, a : a + n].zero_()
        merged = sorted([*self._free, (a, n)])
        self._free = []
        for start, length in merged:
            if self._free and self._free[-1][0] + self._free[-1][1] == start:
                self._free[-1] = (self._free[-1][0], self._free[-1][1] + length)
            else:
                self._free.append((start, length))


class SlabRows(AttentionState):
    """One decode row each of sequences whose caches share one slab, as one state: an update writes every row's
    new position with one ``index_copy_`` per tensor, and each row's query sees its own range."""

    def __init__(
        self,
        caches: list[SlabCache],
        rows: torch.Tensor,
        positions: torch.Tensor,
        first: torch.Tensor,
        lengths: list[int],
        every_row: bool,
    ):
        self.caches = caches
        self.rows = rows  # [S] the rows' places among the step's rows
        self.positions = positions  # [S] the slab position each writes
        self.first = first  # [S] the first slab position of each one's range
        self.lengths = lengths  # each one's cache length after this step
        self.longest = max(lengths)
        self.every_row = every_row  # the step is these rows only, in this order
        self._masks: dict[int | None, torch.Tensor] = {}
        self._ranges: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def of(cls, caches: list[SlabCache], rows: list[int], every_row: bool, device: torch.device) -> SlabRows | None:
        """``caches`` (one decode row each, at step ``rows``) as one state, or None where they cannot step as one:
        fewer than two, more than one slab, or a range whose gathered positions (``longest`` from its start) would
        run past the slab's end."""
        if len(caches) < 2 or len({id(c.slab) for c in caches}) != 1:
            return None
        starts, offsets = [c.length for c in caches], [c.offset for c in caches]  # lengths before the step
        if max(offsets) + max(n + 1 for n in starts) > caches[0].slab.positions:
            return None
        return cls(
            caches,
            torch.tensor(rows, device=device),
            torch.tensor([o + n for o, n in zip(offsets, starts)], device=device),
            torch.tensor(offsets, device=device),
            [n + 1 for n in starts],
            every_row,
        )

    def update(self, layer: int, *new: torch.Tensor) -> Held:
        """``new``: the rows' k and v [1, kv heads, S, d] (or MLA's latent), in the order of :attr:`caches`."""
        held = self.caches[0].slab.buffers[layer]
        for buf, x in zip(held, new):
            buf[0].index_copy_(1, self.positions, x[0])
        for c in self.caches:
            c.layers[layer].length += 1
        return Held(tuple(held), rows=self)

    def views(self, layer: int) -> list[tuple[torch.Tensor, ...]]:
        """Each row's own cache of ``layer`` after the update, as a sequence's prefix (its query the last position)."""
        return [tuple(b.narrow(2, 0, c.layers[layer].length) for b in c.layers[layer].buffers) for c in self.caches]

    @functools.cached_property
    def gather(self) -> torch.Tensor:
        """[S * longest] slab positions of each range's first ``longest`` positions (past its own end: masked); made
        only for the gathered attention (the native kernel and MLA's rows read their ranges in place)."""
        return (self.first[:, None] + torch.arange(self.longest, device=self.first.device)[None, :]).flatten()

    def ranges(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """([S] first slab position, [S] count) of the positions each row sees (its last ``window``), int64 on the
        host: the native decode attention reads them in place, no gather and no mask."""
        r = self._ranges.get(window)
        if r is None:
            n = torch.tensor(self.lengths, dtype=torch.int64, device="cpu")  # the kernel reads them on the host
            seen = n if window is None else n.clamp(max=window)
            r = self._ranges[window] = (self.first.to("cpu", torch.int64) + n - seen, seen)
        return r

    def mask(self, window: int | None) -> torch.Tensor:
        """[S, 1, 1, longest]: row j sees its own first ``lengths[j]`` positions (the last ``window`` of them)."""
        m = self._masks.get(window)
        if m is None:
            key = torch.arange(self.longest, device=self.positions.device)[None, :]
            n = torch.tensor(self.lengths, device=key.device)[:, None]
            m = key < n
            if window is not None:
                m &= key >= n - window
            self._masks[window] = m = m[:, None, None, :]
        return m
