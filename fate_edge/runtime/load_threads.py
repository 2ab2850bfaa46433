"""Loading where no thread of the process will compute (its own short-lived thread), so OpenMP keeps one team.

Why: every thread that runs a parallel region with several threads keeps its own pool of OpenMP helper threads
until it exits, and libgomp (torch's and the one fate-edge's kernels link) cuts its spin-waiting to ~100 iterations
once it manages more threads than the process's CPUs. An engine loaded with 2 torch threads left the loading
thread's helpers behind, and the batcher thread's own team then slept at every barrier (a several times slower decode:
docs/measured-choices.md).
Work run through :func:`in_own_thread` keeps every torch thread, and its helpers end with its thread. A caller that
runs multi-threaded torch work in another long-lived thread of the process (its own model) brings the slowdown back;
docs/batching.md says so.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def exit_if_loading(status: int) -> None:
    """End the process now with ``status`` when a load (a conversion, the planner's probes) still runs on its own
    thread: the interpreter's exit would stop that thread inside torch's C++ code, which aborts the process
    (SIGABRT, status 134) instead of exiting. Nothing is lost: a conversion writes into a working folder that the
    next one removes (format.work_dirs)."""
    import os
    import sys

    if any(t.name == LOAD_THREAD and t.is_alive() for t in threading.enumerate()):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(status)


LOAD_THREAD = "fate-edge-load"


def in_own_thread(fn: Callable[[], T], name: str = LOAD_THREAD) -> T:
    """``fn()`` on a thread of its own, waited for: its result, or its exception raised here."""
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # handed to the caller, whatever it is
            error.append(e)

    thread = threading.Thread(target=target, name=name, daemon=True)  # daemon: an interrupted wait does not hang
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
