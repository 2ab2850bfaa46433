"""Writing big output files with O_DIRECT, past the page cache, where the filesystem allows it.

Convert writes each byte once and never reads it back. Through the page cache that costs a copy into dirty
pages and, once the dirty limit is reached, writeback throttling, which made buffered writes several times slower
than O_DIRECT ones to the same disk (docs/measured-choices.md).
O_DIRECT needs page-aligned memory, offsets and lengths, so data goes through an anonymous ``mmap`` buffer
(page-aligned) and the file is cut to its true length at the end. Where the filesystem refuses O_DIRECT
(tmpfs, some network filesystems) the same calls write through the page cache.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from pathlib import Path

ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and memory on every filesystem fate-edge targets


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def open_direct(path: str | Path, flags: int, mode: int = 0o666) -> tuple[int, bool]:
    """``(fd, direct)``: ``path`` opened with O_DIRECT added to ``flags``, or without it (``direct`` False) where
    the filesystem refuses it at open."""
    direct = getattr(os, "O_DIRECT", 0)
    try:
        return os.open(path, flags | direct, mode), bool(direct)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return os.open(path, flags, mode), False


def refused_direct(fd: int, exc: OSError, direct: bool) -> None:
    """After ``exc`` from an I/O call on ``fd``: return where it was O_DIRECT refused at the call (EINVAL), with
    O_DIRECT now off on ``fd`` so the caller retries through the page cache; raise ``exc`` otherwise."""
    if exc.errno != errno.EINVAL or not direct:
        raise exc
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)


class DirectFile:
    """A write-only file: ``write`` appends (staged in an aligned buffer of ``buffer_bytes``), ``pwrite_at``
    writes at an aligned offset (from several threads at once when each passes its own ``staging`` buffer);
    ``close`` cuts the file to the bytes written and fsyncs it."""

    def __init__(self, path: str | Path, buffer_bytes: int = 8 << 20):
        self.fd, self.direct = open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        self.buf = mmap.mmap(-1, _align(buffer_bytes))
        self.fill = 0  # bytes staged in ``buf``
        self.pos = 0  # file offset of buf[0]
        self.size = 0  # the file's true length
        self._size_lock = threading.Lock()  # pwrite_at may run on several writer threads

    # ------------------------------------------------------------------ sequential
    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            n = min(len(view) - done, len(self.buf) - self.fill)
            self.buf[self.fill : self.fill + n] = view[done : done + n]
            self.fill += n
            done += n
            if self.fill == len(self.buf):
                self._flush()
        self.size = max(self.size, self.pos + self.fill)
        return done

    def _flush(self) -> None:
        self._pwrite(memoryview(self.buf)[: _align(self.fill)], self.pos)
        self.pos += self.fill
        self.fill = 0

    # ------------------------------------------------------------------ slots
    def pwrite_at(self, data, offset: int, staging: Staging | None = None) -> None:
        """Write ``data`` at ``offset`` (a multiple of ALIGN), zero-padded to a whole ALIGN block. ``staging``: the
        calling thread's own aligned buffer (the file's is shared), for writes from several threads at once."""
        view = memoryview(data).cast("B")
        if offset % ALIGN:
            raise ValueError(f"pwrite_at: offset {offset} is not a multiple of {ALIGN}")
        padded = _align(len(view))
        if staging is None:
            if len(self.buf) < padded:
                self.buf.close()
                self.buf = mmap.mmap(-1, padded)
            buf = self.buf
        else:
            buf = staging.reserve(padded)
        buf[: len(view)] = view
        buf[len(view) : padded] = bytes(padded - len(view))
        self._pwrite(memoryview(buf)[:padded], offset)
        with self._size_lock:
            self.size = max(self.size, offset + len(view))

    def _pwrite(self, view: memoryview, offset: int) -> None:
        while len(view):
            try:
                n = os.pwrite(self.fd, view, offset)
            except OSError as exc:  # O_DIRECT accepted at open, refused at write: go through the page cache
                refused_direct(self.fd, exc, self.direct)
                self.direct = False
                continue
            view, offset = view[n:], offset + n

    def truncate(self, size: int) -> None:
        """Set the file's final length (slots: the whole last slot)."""
        self.size = size

    def close(self) -> None:
        if self.fd < 0:
            return
        try:
            if self.fill:
                self._flush()
            os.ftruncate(self.fd, self.size)
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.fd = -1
            self.buf.close()

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:  # the caller failed (disk full, ...): leave the partial file as it is, report the first error
            os.close(self.fd)
            self.fd = -1
            self.buf.close()


class Staging:
    """One writer thread's page-aligned buffer for :meth:`DirectFile.pwrite_at`, grown to the largest blob."""

    def __init__(self) -> None:
        self.buf: mmap.mmap | None = None

    def reserve(self, nbytes: int) -> mmap.mmap:
        if self.buf is None or len(self.buf) < nbytes:
            self.close()
            self.buf = mmap.mmap(-1, _align(nbytes))
        return self.buf

    def close(self) -> None:
        if self.buf is not None:
            self.buf.close()
            self.buf = None
