"""Expert blobs written at their slots by writer threads, off the thread that collects them.

Convert's main thread used to ``pwrite`` each blob itself (O_DIRECT, one request at a time): while it waited the
encoders ran out of queued work, and between two writes the disk had nothing to do. Here it hands each blob to a
bounded queue and goes on; ``writers`` threads take blobs from it, so that many writes are outstanding at once and
the queue holds at most ``depth`` blobs (memory stays a few blobs' worth whatever the model's size).
"""

from __future__ import annotations

import queue
import threading

from fate_edge.format.direct_write import DirectFile, Staging

WRITERS = 2  # writes outstanding at once: the disk queue stays full while one thread copies into its buffer
DEPTH = 4  # blobs waiting in the queue


class BlobWriter:
    """``put(file, blob, offset)`` queues one write; ``close()`` waits for every queued write and raises the
    first error a writer met; ``abort()`` drops what is still queued and waits for the writers to stop."""

    def __init__(self, writers: int = WRITERS, depth: int = DEPTH):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._dropping = False  # after an error or abort: take queued blobs off, write nothing more
        self._threads = [
            threading.Thread(target=self._run, name=f"convert-write-{i}", daemon=True) for i in range(writers)
        ]
        for t in self._threads:
            t.start()

    def put(self, file: DirectFile, blob, offset: int) -> None:
        """Queue ``blob`` for ``file`` at ``offset``; waits while the queue is full, raises a writer's error."""
        while True:
            self._raise()
            try:
                self._queue.put((file, blob, offset), timeout=0.1)  # wakes to see a writer's error
                return
            except queue.Full:
                continue

    def close(self) -> None:
        """Wait until every queued blob is written; raise the first write error."""
        self._stop()
        self._raise()

    def abort(self) -> None:
        """Write nothing more; return once no writer touches a file (the caller may close them then)."""
        self._dropping = True
        self._stop()

    def _stop(self) -> None:
        for t in self._threads:
            if t.is_alive():
                self._queue.put(None)  # writers keep draining the queue, so this never waits long
        for t in self._threads:
            t.join()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        staging = Staging()  # this thread's aligned buffer: writers copy and write in parallel
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    return
                if self._dropping:
                    continue
                file, blob, offset = item
                try:
                    file.pwrite_at(blob, offset, staging)
                except BaseException as exc:  # reported to the caller by put() or close()
                    if self._error is None:
                        self._error = exc
                    self._dropping = True
                del item, blob
        finally:
            staging.close()
