"""Engines still open when the interpreter exits are closed first, so no engine thread computes during finalization.

Why: at exit CPython stops every daemon thread that next asks for the GIL with ``pthread_exit``, whose forced unwind
through torch's C++ frames (a step of the batcher thread, say) ends in ``std::terminate``: a script that left a
stream open, or an app holding an engine in a global, died with "terminate called without an active exception"
and status 134 (SIGABRT). atexit handlers run before that point, and closing an engine joins its batcher thread
after its step and stops its fetch workers.
"""

from __future__ import annotations

import atexit
import weakref
from typing import Protocol


class _Closable(Protocol):
    def close(self) -> None: ...


_open: weakref.WeakSet = weakref.WeakSet()


def close_at_exit(engine: _Closable) -> None:
    """Close ``engine`` at interpreter exit unless it is closed (and :func:`closed`) before."""
    _open.add(engine)


def closed(engine: _Closable) -> None:
    _open.discard(engine)


@atexit.register
def _close_open_engines() -> None:
    for engine in list(_open):
        try:
            engine.close()
        except Exception:  # exiting anyway: one engine's failure must not keep the others' threads running
            pass
