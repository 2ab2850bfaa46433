"""One piece of work on its own thread, beside the caller's: its failure reaches the caller, and the caller can
stop it. Convert writes the resident weights this way while its main thread writes the experts."""

from __future__ import annotations

import threading
from collections.abc import Callable

from fate_edge.errors import ConvertStopped


class Background:
    """``work(stop)`` started on a thread now. ``stop`` is a ``threading.Event`` the work checks between steps
    (and raises :class:`ConvertStopped` when set). ``check()`` raises its error in the caller's thread as soon as it has
    failed, ``result()`` waits for it and raises its error, ``cancel()`` sets ``stop`` and waits for it to end."""

    def __init__(self, work: Callable[[threading.Event], None], name: str):
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(work,), name=name, daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[threading.Event], None]) -> None:
        try:
            work(self._stop)
        except BaseException as exc:  # raised again in the caller's thread
            self._error = exc

    def check(self) -> None:
        """Raise the work's error if it has failed (a stop the caller asked for is no failure)."""
        if self._error is not None and not isinstance(self._error, ConvertStopped):
            raise self._error

    def result(self) -> None:
        """Wait for the work to end; raise its error."""
        self._thread.join()
        self.check()

    def cancel(self) -> None:
        """Ask the work to stop and wait until it has: it touches nothing of the caller's after this returns."""
        self._stop.set()
        self._thread.join()
