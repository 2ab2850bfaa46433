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

import signal
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

    running = any(t.name == LOAD_THREAD and t.is_alive() for t in threading.enumerate())
    # a load whose wait was interrupted may be ending at this instant: no longer alive, but its thread still in
    # torch's thread teardown, which the interpreter's exit aborts as surely as a running load
    if running or _interrupted_waits:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(status)


LOAD_THREAD = "fate-edge-load"
_interrupted_waits: list[threading.Thread] = []  # loads whose caller stopped waiting (Ctrl-C): see exit_if_loading


_WAKE_S = 0.05


def _leave_signals_to_the_caller() -> None:
    """Block Ctrl-C and the stop signals here (and in the threads this one starts, which inherit the mask): the
    kernel then hands them to a thread that can take them, the waiting caller, at once. A conversion's thread that
    took the SIGINT itself left the caller asleep in join() until the conversion had finished."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})


def in_own_thread(fn: Callable[[], T], name: str = LOAD_THREAD) -> T:
    """``fn()`` on a thread of its own, waited for: its result, or its exception raised here."""
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            _leave_signals_to_the_caller()
            result.append(fn())
        except BaseException as e:  # handed to the caller, whatever it is
            error.append(e)

    thread = threading.Thread(target=target, name=name, daemon=True)  # daemon: an interrupted wait does not hang
    try:
        thread.start()
        while thread.is_alive():  # woken now and then: a signal another thread took is still acted on soon
            thread.join(_WAKE_S)
    except BaseException:
        _interrupted_waits.append(thread)
        raise
    if error:
        raise error[0]
    return result[0]
