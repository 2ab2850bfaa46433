"""Large tensors made in memory (weights quantized at load) and the fetch engine's read buffers (which become the
cached experts) on transparent huge pages, where the kernel gives them on request
(``/sys/kernel/mm/transparent_hugepage/enabled`` = ``madvise``, a common default).

Why: decode streams every resident weight once a token, and 4 KB pages cost it (linears quantized at load into
anonymous 4 KB pages decoded about a quarter slower than the same bytes memory-mapped; docs/measured-choices.md).
A copy made here lands in 2 MB pages (the range is
advised before its first touch), and holds no more resident memory than the tensor: only whole huge pages inside
it are advised, the rest of the allocation is never touched.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20
MIN_BYTES = 4 << 20  # smaller tensors gain little and would round to a huge page
_MADV_HUGEPAGE = 14  # Linux
_libc: ctypes.CDLL | None = None


def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    global _libc
    if not sys.platform.startswith("linux"):
        return None
    if _libc is None:
        try:
            _libc = ctypes.CDLL("libc.so.6", use_errno=True)
        except OSError:
            return None
    fn = _libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.cache
def thp_available() -> bool:
    """Whether the kernel gives transparent huge pages on request (``madvise`` or ``always``). Where it never does,
    a copy would only trade the file's reclaimable pages for anonymous ones."""
    try:
        with open(THP_SETTING) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def huge_page_window(nbytes: int) -> tuple[mmap.mmap, int] | None:
    """A private anonymous mapping holding ``nbytes`` from a 2 MB-aligned offset (returned with it), the whole huge
    pages of that window advised and nothing touched yet; None off Linux, below one huge page, or where the advice
    is refused. The window's tail past its last whole huge page is not advised (khugepaged would fill a huge page
    around it past ``nbytes``), and nothing outside the window is ever touched, so the resident memory stays
    ``nbytes``. Private: a shared anonymous mapping is shmem, whose huge pages are another setting, off by
    default."""
    madvise = _madvise()
    if madvise is None or nbytes < HUGE_PAGE or not thp_available():
        return None
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    anchor = ctypes.c_char.from_buffer(mapping)  # the mapping's address (released at once: close() stays possible)
    base = ctypes.addressof(anchor)
    del anchor
    start = (-base) % HUGE_PAGE
    if madvise(base + start, nbytes // HUGE_PAGE * HUGE_PAGE, _MADV_HUGEPAGE) != 0:
        mapping.close()
        return None
    return mapping, start


def _huge_page_bytes(t: torch.Tensor) -> torch.Tensor | None:
    """Untouched memory for ``t``'s bytes (uint8, flat) advised for huge pages, or None where ``t`` stays as it is:
    not a contiguous CPU tensor of at least :data:`MIN_BYTES`, or no window (:func:`huge_page_window`). A mapping
    of its own, so no page of it is touched yet (torch.empty may reuse heap memory already faulted in 4 KB pages,
    depending on what the process freed before); the tensor keeps the mapping alive."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes < MIN_BYTES or not t.is_contiguous():
        return None
    window = huge_page_window(nbytes)
    if window is None:
        return None
    mapping, start = window
    return torch.frombuffer(mapping, dtype=torch.uint8)[start : start + nbytes]


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied into memory advised for huge pages before it is touched: a contiguous CPU tensor of at least
    :data:`MIN_BYTES` on Linux; anything else is returned as it is (as is ``t`` where the advice is refused)."""
    raw = _huge_page_bytes(t)
    if raw is None:
        return t
    out = raw.view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


_MADV_DONTNEED = 4  # Linux
MOVE_CHUNK = 8 << 20  # bytes copied before the source's pages are let go: the load's peak grows by this, not by t


def _release(t: torch.Tensor) -> None:
    """Drop this process's pages of the whole pages inside ``t`` (a read-only view of a private file mapping): they
    leave the resident set, stay in the page cache, and would be read from the file again if touched."""
    madvise = _madvise()
    begin, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    first, last = -(-begin // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    if madvise is not None and last > first:
        madvise(first, last - first, _MADV_DONTNEED)


def moved_to_huge_pages(mapped: torch.Tensor) -> torch.Tensor:
    """A tensor memory-mapped from a store's file (``format.prequantized.MappedFiles``: MAP_PRIVATE, never written)
    copied onto huge pages, the file's pages let go behind the copy as it goes, so the resident memory ends where it
    started plus the tensor (at most :data:`MOVE_CHUNK` more on the way). Why: the kernels stream a store's int4
    ``lm_head`` faster from huge pages than from 4 KB file pages (docs/measured-choices.md).
    Anything :func:`on_huge_pages` would leave as it is is returned as it is. Only for a mapping nothing writes:
    a page written there would be dropped for the file's bytes."""
    out = _huge_page_bytes(mapped)
    if out is None:
        return mapped
    src = mapped.view(-1).view(torch.uint8)
    for at in range(0, out.numel(), MOVE_CHUNK):
        out[at : at + MOVE_CHUNK].copy_(src[at : at + MOVE_CHUNK])
        _release(src[at : at + MOVE_CHUNK])
    return out.view(mapped.dtype).view(mapped.shape)
