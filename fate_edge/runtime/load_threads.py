"""Loading on one torch thread where another thread will compute (the batcher), so OpenMP keeps one team.

Why: every thread that runs a parallel region with several threads keeps its own pool of OpenMP helper threads,
and libgomp (torch's and the one fate-edge's kernels link) cuts its spin-waiting to ~100 iterations once it manages
more threads than the process's CPUs. An engine loaded with 2 torch threads on a 2-core Xeon left the loading
thread's helpers behind; the batcher thread's own team then slept at every barrier: the bundled model decoded at
82 tok/s batched against 356 when the same engine computed on the loading thread, and 336 once the load ran on one
thread (measured 2026-12-05). A caller that runs multi-threaded torch work in another thread of the process
(its own model, a conversion) brings the slowdown back; docs/batching.md says so.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def one_torch_thread(active: bool = True) -> Iterator[None]:
    """torch (and fate-edge's kernels, which take torch's thread count) on one thread for the block, then the
    setting before it; ``active=False``: nothing changes."""
    before = torch.get_num_threads()
    if not active or before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
