"""Which open stream of an engine may run its next step: one request at a time, without holding a lock
across a stream's ``yield``.

A new request waits while the open stream keeps stepping; once that stream has been idle (neither advanced
nor closed) for the idle timeout, the new request supersedes it and the old stream's next step raises
:class:`~fate_edge.errors.StreamSupersededError`. A generator kept alive but abandoned therefore delays
others by at most the timeout instead of blocking them forever.
"""

from __future__ import annotations

import itertools
import threading
import time

from fate_edge.errors import EngineClosedError, StreamSupersededError


class RequestSlot:
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._tickets = itertools.count(1)
        self._owner: int | None = None  # ticket of the open stream
        self._busy = False  # the owner is running a step
        self._idle_since = 0.0
        self._closed = False

    def claim(self, idle_timeout: float) -> int:
        """Wait for the engine (see the module docstring) and return the new stream's ticket."""
        with self._cv:
            while True:
                self._check_open()
                if self._owner is None:
                    break
                if self._busy:
                    self._cv.wait()
                    continue
                idle = time.monotonic() - self._idle_since
                if idle >= idle_timeout:
                    break  # abandoned: supersede it
                self._cv.wait(idle_timeout - idle)
            self._owner, self._busy, self._idle_since = next(self._tickets), False, time.monotonic()
            return self._owner

    def begin(self, ticket: int) -> None:
        """``ticket`` starts a step; raises if it was superseded or the engine closed."""
        with self._cv:
            self._check_open()
            if self._owner != ticket:
                raise StreamSupersededError(
                    "this stream was left idle and a newer request took the engine (an engine serves one request "
                    "at a time); iterate a stream to its end or close() it before starting another"
                )
            self._busy = True

    def end(self, ticket: int) -> None:
        with self._cv:
            if self._owner == ticket:
                self._busy, self._idle_since = False, time.monotonic()
                self._cv.notify_all()

    def release(self, ticket: int) -> None:
        """The stream ended or was closed: the engine is free at once."""
        with self._cv:
            if self._owner == ticket:
                self._owner, self._busy = None, False
                self._cv.notify_all()

    def owns(self, ticket: int) -> bool:
        with self._cv:
            return self._owner == ticket and not self._closed

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine is closed; create a new Engine to serve more requests")
