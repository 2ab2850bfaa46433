"""The asynchronous expert fetch engine: prioritised, merged, cancellable reads of contiguous blobs.

Worker threads ``pread`` blobs into a pool of preallocated, page-aligned buffers (O_DIRECT where the
filesystem allows it, buffered otherwise). Reads ahead go in chunks so a stale prefetch can be dropped part
way; a demand read from the raw disk (no emulated link) goes in one request for the whole blob, because
without kernel readahead the request size sets an O_DIRECT read's speed (whole blobs read much faster than chunks:
docs/measured-choices.md) and a demand read is never dropped but for an abort.
Requests carry a priority (demand > next layer > further ahead); a request for a blob already queued
or in flight is merged into it (and raises its priority). Every request records how long it queued,
read and was waited for. A blob's CRC32 is checked before anyone sees its bytes: on its first read in
this process (``verify="once"``, the default) or on every read (``verify="always"``).

``demand_reserve`` buffers of the pool are for demand reads alone: prefetches hold at most the rest, so a
demand read never waits behind read-ahead (a prefetch promoted to demand while queued may use them too).
A read's buffer can be handed off (:meth:`FetchEngine.hand_off`): its memory becomes the cached expert.
A read can also land in memory of the caller's (``submit(..., into=)``: a host-tier slot, runtime.host_tier), with
no staging buffer and no copy after; the CRC is checked before the request is done, as for any read.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fate_edge.defaults import FETCH_WORKERS
from fate_edge.devices.link import ThrottledLink
from fate_edge.errors import FetchCancelled, FetchError
from fate_edge.fetch.buffer_pool import Buffer, BufferPool
from fate_edge.format.blob import ALIGN, VERIFIED_BLOBS, BlobRef, corrupted, file_identity, truncated
from fate_edge.format.checksum import crc32


class Priority(enum.IntEnum):
    DEMAND = 0  # needed by the layer being computed now
    NEXT_LAYER = 1  # predicted for the next layer
    AHEAD = 2  # predicted further ahead


@dataclass
class FetchRequest:
    ref: BlobRef
    priority: Priority
    seq: int
    submitted_at: float = field(default_factory=time.perf_counter)
    state: str = "queued"  # queued | reading | done | failed | cancelled
    buffer: Buffer | None = None
    error: Exception | None = None
    bytes_read: int = 0
    queued_s: float = 0.0
    read_s: float = 0.0
    throttled_s: float = 0.0
    waited_s: float = 0.0
    cpu_s: float = 0.0  # the reader thread's CPU time for this read
    cancel_requested: bool = False
    holds_prefetch_buffer: bool = False  # counted against the prefetches' share of the pool
    into: memoryview | None = None  # the caller's memory the read lands in (not a pool buffer)
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def payload(self) -> memoryview:
        assert self.buffer is not None
        return self.buffer.view[: self.ref.length]


@dataclass
class FetchStats:
    requests: int = 0
    merged: int = 0
    cancelled: int = 0
    bytes_read: int = 0
    reads_completed: int = 0
    failures: int = 0
    cpu_s: float = 0.0  # reader threads' CPU time (thread_time), excluding link-throttle sleeps
    read_s: float = 0.0  # wall time of completed reads, throttle included


class FetchEngine:
    def __init__(
        self,
        pool: BufferPool,
        workers: int | None = None,  # None: defaults.FETCH_WORKERS (fits the cores beside torch's threads)
        link: ThrottledLink | None = None,
        direct_io: bool = True,
        chunk_bytes: int = 1 << 20,  # reads ahead (and every read through an emulated link)
        fault_injector: Callable[[BlobRef], None] | None = None,
        verify: str = "once",
        demand_reserve: int = 0,  # buffers prefetches never take (see the module docstring)
    ):
        if verify not in ("once", "always"):
            raise ValueError(f"verify must be 'once' or 'always', got {verify!r}")
        self.pool = pool
        self.prefetch_cap = max(0, pool.count - demand_reserve)  # buffers prefetch reads may hold at once
        self._prefetch_held = 0
        # "once": each blob's CRC is checked on its first read in this process, which catches what
        # was corrupted or truncated at rest; later re-reads of a verified blob skip the CRC, the largest
        # CPU cost of a read (fate_edge.format.checksum; docs/measured-choices.md), so evict-and-reload traffic
        # does not steal compute. "always" checks every read.
        self.verify = verify
        self._ident: dict[str, tuple[int, int, int]] = {}
        self.link = link
        self.chunk_bytes = max(ALIGN, chunk_bytes // ALIGN * ALIGN)
        self.want_direct = direct_io
        self.direct_io_note = "not requested" if not direct_io else "not yet opened"
        self.fault_injector = fault_injector  # tests and fault drills: raise to simulate a failing read
        self.stats = FetchStats()
        self._heap: list[tuple[int, int, FetchRequest]] = []
        self._pending: dict[tuple[int, int, int], FetchRequest] = {}
        self._cv = threading.Condition()
        self.completed = threading.Condition()  # notified whenever any request finishes, fails or is cancelled
        self._seq = itertools.count()
        self._fds: dict[str, int] = {}
        self._fd_lock = threading.Lock()
        self._closed = False
        self.close_timeout = 5.0  # close() waits this long for the workers before leaving the files to them
        self._threads = [
            threading.Thread(target=self._worker, name=f"fate-fetch-{i}", daemon=True)
            for i in range(FETCH_WORKERS if workers is None else workers)
        ]
        self._alive = len(self._threads)  # workers not yet exited (guarded by _fd_lock)
        for t in self._threads:
            t.start()

    @property
    def workers(self) -> int:
        return len(self._threads)

    # ------------------------------------------------------------------ API
    def submit(
        self, ref: BlobRef, priority: Priority = Priority.DEMAND, into: memoryview | None = None
    ) -> FetchRequest:
        """Queue a read of ``ref`` (or join the identical read already queued or in flight: then ``req.into`` is
        not ``into``). ``into``: the caller's memory to read into, at least ``ref.read_length`` bytes (aligned for
        O_DIRECT), written by a reader until the request is done; :meth:`release` gives no buffer back then."""
        if into is not None and len(into) < ref.read_length:
            raise ValueError(f"{ref.where()}: {len(into)} bytes to read into, the read needs {ref.read_length}")
        with self._cv:
            if self._closed:
                raise FetchError("fetch engine is closed")
            self.stats.requests += 1
            req = self._pending.get(ref.key)
            if req is not None and not req.cancel_requested:
                self.stats.merged += 1
                if priority < req.priority:
                    req.priority = priority
                    if req.state == "queued":
                        heapq.heappush(self._heap, (int(priority), req.seq, req))
                return req
            req = FetchRequest(ref, priority, next(self._seq), into=into)
            self._pending[ref.key] = req
            heapq.heappush(self._heap, (int(priority), req.seq, req))
            self._cv.notify()
            return req

    def promote(self, req: FetchRequest, priority: Priority) -> None:
        """Raise a request's priority (a prefetch that became a demand): a queued one is read sooner, one
        being read reads its remaining bytes as a demand read does (one request, see the module docstring)."""
        with self._cv:
            if req.state in ("queued", "reading") and not req.cancel_requested and priority < req.priority:
                req.priority = priority
                if req.state == "queued":
                    heapq.heappush(self._heap, (int(priority), req.seq, req))
                    self._cv.notify()

    def cancel(self, req: FetchRequest) -> None:
        """Drop a request: never read if still queued, stopped at the next chunk if reading."""
        with self._cv:
            if req.state in ("done", "failed", "cancelled"):
                return
            req.cancel_requested = True
            if req.state == "queued":
                self._finish_cancelled(req)

    def wait(self, req: FetchRequest, timeout: float | None = None) -> memoryview:
        """Block until ``req`` is read; returns its payload (valid until :meth:`release`)."""
        t0 = time.perf_counter()
        if not req.done.wait(timeout):
            raise FetchError(f"timed out after {timeout}s waiting for {req.ref.where()}")
        req.waited_s += time.perf_counter() - t0
        if req.state == "cancelled":
            raise FetchCancelled(f"request for {req.ref.where()} was cancelled")
        if req.error is not None:
            raise req.error
        return req.payload

    def release(self, req: FetchRequest) -> None:
        """Give the request's buffer back to the pool once its bytes have been consumed."""
        with self._cv:
            buf, req.buffer = req.buffer, None
            self._unhold(req)
        if buf is not None and req.into is None:  # the caller's memory is not the pool's
            self.pool.release(buf)

    def hand_off(self, req: FetchRequest, replacement: Buffer | None = None) -> Buffer:
        """Take a finished request's buffer for good (zero-copy: the expert decoded in it is kept); the pool
        gets ``replacement`` or a new buffer in its place (:meth:`BufferPool.hand_off`)."""
        with self._cv:
            buf, req.buffer = req.buffer, None
            self._unhold(req)
        assert buf is not None and req.into is None, f"{req.ref.where()}: no pool buffer to hand off"
        return self.pool.hand_off(buf, replacement)

    def close(self) -> None:
        """Stop the workers: queued reads are cancelled and reads in progress stop at their next chunk.
        A file descriptor is closed only once no worker is left to use it: here if every worker exits
        within ``close_timeout``, else by the last worker on its way out (never under a worker's read)."""
        with self._cv:
            self._closed = True
            for _, _, req in self._heap:
                if req.state == "queued":
                    self._finish_cancelled(req)
            for req in self._pending.values():  # those being read
                req.cancel_requested = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=self.close_timeout)
        self._close_files()

    def _close_files(self) -> None:
        with self._fd_lock:
            if self._alive:
                return  # the last worker to exit closes them
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> FetchEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -------------------------------------------------------------- internals
    def _unhold(self, req: FetchRequest) -> None:
        """The request's buffer no longer counts against the prefetches' share (caller holds ``_cv``)."""
        if req.holds_prefetch_buffer:
            req.holds_prefetch_buffer = False
            self._prefetch_held -= 1
            self._cv.notify_all()  # a worker may be waiting for the share to start a prefetch

    def _startable(self, prio: int) -> bool:
        return prio == Priority.DEMAND or self._prefetch_held < self.prefetch_cap

    def _finish_cancelled(self, req: FetchRequest) -> None:
        req.state = "cancelled"
        self._unhold(req)
        self.stats.cancelled += 1
        if self._pending.get(req.ref.key) is req:
            del self._pending[req.ref.key]
        self._notify_done(req)

    def _notify_done(self, req: FetchRequest) -> None:
        req.done.set()
        with self.completed:
            self.completed.notify_all()

    @staticmethod
    def _valid(prio: int, req: FetchRequest) -> bool:
        return req.state == "queued" and prio == int(req.priority) and not req.cancel_requested

    def _wait_for_work(self) -> bool:
        """Block until a request is queued (True) or the engine closes (False). Caller holds no buffer."""
        with self._cv:
            while True:
                while self._heap and not self._valid(self._heap[0][0], self._heap[0][2]):
                    heapq.heappop(self._heap)  # stale entry: cancelled, or re-queued at a higher priority
                # A prefetch waits while the prefetches' share of buffers is held (a release notifies).
                if self._heap and self._startable(self._heap[0][0]):
                    return True
                if self._closed:
                    return False
                self._cv.wait()

    def _pop_ready(self) -> FetchRequest | None:
        """The most urgent queued request, marked as reading; None if another worker took the last one."""
        with self._cv:
            while self._heap:
                prio, _, req = self._heap[0]
                if not self._valid(prio, req):
                    heapq.heappop(self._heap)
                    continue
                if not self._startable(prio):
                    return None  # prefetch share held; the buffer goes back for a demand read
                heapq.heappop(self._heap)
                req.state = "reading"
                if prio != Priority.DEMAND:
                    req.holds_prefetch_buffer = True
                    self._prefetch_held += 1
                return req
            return None

    def _fd(self, path: str) -> int:
        with self._fd_lock:
            fd = self._fds.get(path)
            if fd is not None:
                return fd
            fd = -1
            if self.want_direct and hasattr(os, "O_DIRECT"):
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                    probe = mmap.mmap(-1, ALIGN)
                    os.preadv(fd, [memoryview(probe)], 0)
                    self.direct_io_note = "O_DIRECT"
                except OSError as exc:  # tmpfs, some overlay filesystems: no O_DIRECT
                    if fd >= 0:
                        os.close(fd)
                    fd = -1
                    self.direct_io_note = f"buffered (O_DIRECT unavailable here: {exc.strerror})"
            if fd < 0:
                fd = os.open(path, os.O_RDONLY)
                if not self.want_direct or not hasattr(os, "O_DIRECT"):
                    self.direct_io_note = "buffered"
            self._ident[path] = file_identity(fd)
            self._fds[path] = fd
            return fd

    def _worker(self) -> None:
        try:
            self._work()
        finally:
            with self._fd_lock:
                self._alive -= 1
            if self._closed:
                self._close_files()

    def _work(self) -> None:
        while True:
            # Wait for work, take a buffer, and only then the most urgent request: a worker never holds a
            # request it cannot read, so the most urgent request always gets the next free buffer (no
            # deadlock when more requests are queued than there are buffers; idle workers hold none).
            if not self._wait_for_work():
                return
            buf = self.pool.acquire(lambda: self._closed)
            if buf is None:
                return
            req = self._pop_ready()
            if req is None:
                self.pool.release(buf)
                continue
            if req.into is not None:  # into the caller's memory: the pool's buffer goes back at once
                self.pool.release(buf)
                buf = Buffer.over(req.into)
            self._read(req, buf)

    def _give_back(self, req: FetchRequest, buf: Buffer) -> None:
        """A read that did not complete: its pool buffer back (the caller's memory stays the caller's)."""
        if req.into is None:
            self.pool.release(buf)

    def _read(self, req: FetchRequest, buf: Buffer) -> None:
        ref = req.ref
        start = time.perf_counter()
        cpu0 = time.thread_time()
        req.queued_s = start - req.submitted_at
        issued = time.monotonic()  # the link's clock: emulated transfer overlaps this request's real reads
        if buf.size < ref.read_length:
            self._give_back(req, buf)
            self._fail(
                req,
                FetchError(
                    f"{ref.where()}: blob of {ref.length} bytes exceeds the buffer size "
                    f"{buf.size}; the store and the engine disagree on the largest blob"
                ),
            )
            return
        try:
            if self.fault_injector is not None:
                self.fault_injector(ref)
            fd = self._fd(ref.path)
            pos = 0
            vkey = (*self._ident[ref.path], ref.offset)
            check = self.verify == "always" or vkey not in VERIFIED_BLOBS
            crc = 0  # computed chunk by chunk while the bytes are cache-hot (and while a link throttle sleeps)
            while pos < ref.read_length:
                if req.cancel_requested:  # stale prefetch: stop between chunks, no further I/O
                    self._give_back(req, buf)
                    with self._cv:
                        self._finish_cancelled(req)
                    return
                n = ref.read_length - pos
                if self.link is not None or req.priority != Priority.DEMAND:
                    n = min(self.chunk_bytes, n)
                got = os.preadv(fd, [buf.view[pos : pos + n]], ref.offset + pos)
                if got <= 0:
                    raise truncated(ref, pos)
                if self.link is not None:
                    req.throttled_s += self.link.reserve(got, first_chunk=pos == 0, issued_at=issued)
                if check:
                    crc = crc32(buf.view[pos : min(pos + got, ref.length)], crc)
                pos += got
                req.bytes_read += got
                with self._cv:
                    self.stats.bytes_read += got
                if got < n and pos < ref.length:
                    raise truncated(ref, pos)
            if check:
                if crc != ref.crc32:
                    raise corrupted(ref)
                VERIFIED_BLOBS.add(vkey)
        except Exception as exc:
            self._give_back(req, buf)
            self._fail(req, exc if isinstance(exc, FetchError) else FetchError(f"{ref.where()}: read failed: {exc}"))
            return
        req.read_s = time.perf_counter() - start
        with self._cv:
            req.cpu_s = time.thread_time() - cpu0
            self.stats.cpu_s += req.cpu_s
            self.stats.read_s += req.read_s
            req.buffer = buf
            req.state = "done"
            self.stats.reads_completed += 1
            if self._pending.get(ref.key) is req:
                del self._pending[ref.key]
        self._notify_done(req)

    def _fail(self, req: FetchRequest, exc: Exception) -> None:
        with self._cv:
            self._unhold(req)
            req.error = exc
            req.state = "failed"
            self.stats.failures += 1
            if self._pending.get(req.ref.key) is req:
                del self._pending[req.ref.key]
        self._notify_done(req)
