"""An engine's threads stop when it is closed, when it is dropped unclosed, or at interpreter exit, whichever comes
first, so no engine thread computes during finalization or outlives its engine.

Why: at exit CPython stops every daemon thread that next asks for the GIL with ``pthread_exit``, whose forced unwind
through torch's C++ frames (a step of the batcher thread, say) ends in ``std::terminate``: a script that left a
stream open, or an app holding an engine in a global, died with "terminate called without an active exception"
and status 134 (SIGABRT). An engine dropped without close() (made inside a function whose stream was left
unfinished) was collected while its batcher and fetch threads ran on, holding the model, and died the same way at
exit. A ``weakref.finalize`` covers all three: it runs once, at close(), at collection or before finalization.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from fate_edge.runtime.prompt_heap import Claim, engine_closed

if TYPE_CHECKING:
    from fate_edge.fetch.fetch_engine import FetchEngine
    from fate_edge.runtime.batch import Batcher
    from fate_edge.runtime.cache import ExpertCache
    from fate_edge.runtime.host_tier import HostTier
    from fate_edge.runtime.request_slot import RequestSlot
    from fate_edge.runtime.scheduler import Scheduler


def shut_down_with(engine: object, shut: Callable[[], None]) -> weakref.finalize:
    """Run ``shut`` (which must not refer to ``engine``, or the engine is never collected) once: when the returned
    finalizer is called (close()), when ``engine`` is collected, or at interpreter exit. Errors at exit are the
    finalizer's to print: one engine's failure does not keep another's threads running."""
    return weakref.finalize(engine, shut)


def shut_down(
    batcher: Batcher | None,
    slot: RequestSlot,
    lock: threading.Lock,
    scheduler: Scheduler,
    cache: ExpertCache | None,
    fetch: FetchEngine,
    host_tier: HostTier | None,
    heap: Claim | None = None,
) -> None:
    """Engine.close's work, from the engine's parts: the finalizer must not hold the engine itself."""
    if batcher is not None:
        batcher.close()  # its sequences end with EngineClosedError
    slot.close()  # no step starts from now on ...
    with lock:  # ... and the one running ends first
        scheduler.abort()
        if cache is not None:
            cache.clear()
        fetch.close()
        if host_tier is not None:
            host_tier.close()
    if heap is not None:
        engine_closed(heap)  # glibc's mmap threshold back to 1 MiB if this engine raised it (runtime.prompt_heap)
