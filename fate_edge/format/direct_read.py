"""Large reads of a file past the page cache (O_DIRECT) where the filesystem allows it, buffered elsewhere.

Convert reads every byte of its input once. A buffered ``pread`` of a few MB goes to the disk as the kernel's readahead
windows, one after another, and is then copied out of the page cache; an O_DIRECT read of the same range goes to the
disk as one request split across the device queue (docs/measured-choices.md). O_DIRECT needs page-aligned offsets,
lengths and memory: a range is read from the page below its start to the page above its end into an anonymous ``mmap``
(page-aligned), and the caller gets a view of its own bytes. Where the filesystem refuses O_DIRECT (tmpfs, some network
filesystems) the same call reads through the page cache and tells the kernel to drop what it read.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

from fate_edge.format.direct_write import ALIGN, open_direct, refused_direct


class DirectReader:
    """``read(begin, length)``: bytes ``begin .. begin + length`` of ``path`` as a uint8 array of their own."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.fd, self.direct = open_direct(self.path, os.O_RDONLY)

    def read(self, begin: int, length: int) -> np.ndarray:
        """The ``length`` bytes at ``begin``; an error if the file ends before them."""
        lo = begin - begin % ALIGN if self.direct else begin
        hi = -(-(begin + length) // ALIGN) * ALIGN if self.direct else begin + length
        buf = mmap.mmap(-1, max(hi - lo, 1))
        view, offset = memoryview(buf)[: hi - lo], lo
        while len(view):
            try:
                got = os.preadv(self.fd, [view], offset)
            except OSError as exc:  # O_DIRECT accepted at open, refused at read: go through the page cache
                refused_direct(self.fd, exc, self.direct)
                self.direct = False
                continue
            if got == 0:  # end of file: fine past the range's last byte (O_DIRECT reads whole pages)
                break
            view, offset = view[got:], offset + got
        del view
        if offset < begin + length:
            raise EOFError(f"{self.path}: ends at byte {offset}, before byte {begin + length}")
        if not self.direct and hasattr(os, "posix_fadvise"):  # each byte is read once: keep no page cache of it
            os.posix_fadvise(self.fd, begin, length, os.POSIX_FADV_DONTNEED)
        return np.frombuffer(buf, np.uint8, length, begin - lo)

    def close(self) -> None:
        if getattr(self, "fd", -1) >= 0:  # absent when __init__ raised
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()
