"""Preallocated, page-aligned read buffers: the fetch engine reads into them and never allocates.

A buffer can also be handed off (:meth:`BufferPool.hand_off`): its memory becomes a cached expert (no copy out
of it) and another buffer takes its place (the memory of an expert the cache evicted, or a new one), so the pool
keeps ``count`` buffers and the bytes stay bounded.

Memory is faulted in when a buffer is made (``MAP_POPULATE``), not by the first read into it: a read into fresh
pages pays their faults (and, in a memory cgroup at its limit, the reclaim each new page triggers) on the
reader's thread while the token waits. Spares (:meth:`BufferPool.add_spares`) are buffers made at load for the
cache to keep, so its first ``n`` hand-offs take faulted-in memory too.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from fate_edge.format.blob import ALIGN
from fate_edge.huge_pages import huge_page_window

if TYPE_CHECKING:
    import torch

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: fault every page in at mmap time


class Buffer:
    """A page-aligned slab from the pool: anonymous mmap, or pinned (page-locked) memory for GPU copies."""

    def __init__(self, size: int, pinned: bool = False):
        self.size = size
        self.mem: torch.Tensor | mmap.mmap | memoryview
        if pinned:
            import torch

            # Page-locked so the GPU can DMA from it; over-allocate to hand out a 4096-aligned window (O_DIRECT).
            pinned_mem = self.mem = torch.empty(size + ALIGN, dtype=torch.uint8).pin_memory()
            skip = (-pinned_mem.data_ptr()) % ALIGN
            self.view = pinned_mem.numpy().data[skip : skip + size]
        elif (window := huge_page_window(size) if _POPULATE else None) is not None:
            # On 2 MB pages where it holds whole ones (Linux, THP madvise or always): the kernels stream a cached
            # expert from here, and 4 KB pages slow them (docs/measured-choices.md). Zeroed at once: faulted in
            # as MAP_POPULATE would, but after the advice.
            self.mem, start = window
            self.view = memoryview(window[0])[start : start + size]
            ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(self.view)), 0, size)
        else:
            # anonymous mmap: page-aligned, as O_DIRECT needs; populated, so no read pays its page faults
            if _POPULATE:
                anon = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
            else:  # no MAP_POPULATE (macOS, Windows, whose mmap takes no flags): pages fault in on first use
                anon = mmap.mmap(-1, size)
            self.mem = anon
            self.view = memoryview(anon)

    @classmethod
    def over(cls, view: memoryview) -> Buffer:
        """A buffer over memory the caller owns (a host-tier slot): read into, never pooled."""
        buf = cls.__new__(cls)
        buf.size, buf.mem, buf.view = len(view), view, view
        return buf


class BufferPool:
    """Fixed number of fixed-size buffers, allocated once: reads never allocate, and their bytes are bounded."""

    def __init__(self, count: int, size: int, pinned: bool = False):
        if count < 1:
            raise ValueError("BufferPool needs at least one buffer")
        self.size = -(-size // ALIGN) * ALIGN
        self.pinned = pinned
        self._free = [Buffer(self.size, pinned) for _ in range(count)]
        self.count = count
        self.handed_off = 0  # buffers whose memory left the pool as a cached expert
        self.recycled = 0  # ... replaced by an evicted expert's buffer (no new memory to fault in)
        self.spares_used = 0  # ... replaced by a spare made at load
        self._spares: list[Buffer] = []
        self._cv = threading.Condition()

    @property
    def nbytes(self) -> int:
        return self.count * self.size

    def acquire(self, stop: Callable[[], bool] | None = None) -> Buffer | None:
        """A free buffer, waiting for one; None once ``stop()`` turns true (the engine is closing)."""
        with self._cv:
            while not self._free:
                if stop is not None and stop():
                    return None
                self._cv.wait(timeout=0.1 if stop is not None else None)
            return self._free.pop()

    def release(self, buf: Buffer) -> None:
        with self._cv:
            self._free.append(buf)
            self._cv.notify()

    def add_spares(self, count: int) -> None:
        """Make ``count`` buffers now (faulted in) for :meth:`hand_off` to put in place of the ones handed off: the
        memory a cache of ``count`` entries will keep, committed at load instead of one expert at a time while
        tokens wait. It is memory the budget already holds for the cache, so the bytes stay bounded."""
        spares = [Buffer(self.size, self.pinned) for _ in range(max(count, 0))]
        with self._cv:
            self._spares.extend(spares)

    @property
    def spares(self) -> int:
        with self._cv:
            return len(self._spares)

    def hand_off(self, buf: Buffer, replacement: Buffer | None = None) -> Buffer:
        """``buf`` (taken from this pool) leaves it for good, its memory now the caller's (a cached expert
        decoded in place). ``replacement`` (a buffer of this size nothing uses any more) takes its place, else a
        spare (:meth:`add_spares`), else a new buffer allocated here, on the caller's thread."""
        if replacement is not None and replacement.size != self.size:
            raise ValueError(f"replacement buffer of {replacement.size} bytes for a pool of {self.size}-byte buffers")
        with self._cv:
            spare = self._spares.pop() if replacement is None and self._spares else None
            self._free.append(replacement or spare or Buffer(self.size, self.pinned))
            self.handed_off += 1
            self.recycled += replacement is not None
            self.spares_used += spare is not None
            self._cv.notify()
        return buf

    @property
    def available(self) -> int:
        with self._cv:
            return len(self._free)
