"""A loaded engine's first tokens, computed at load on the thread that will compute every request's.

Why: a batched engine computes on its batcher's thread, which starts with the first request. That request then also
paid for the thread's OpenMP team and its first run of each operator: at two threads a fresh process's first prompt
was slower than its next ones, and tokens run through the model at load took most of that away
(docs/measured-choices.md). llama.cpp warms up at load for the same reason.

Only where the cache holds the model (nothing to read, so nothing is fetched, evicted or learned from a token no
one asked for) and requests are batched (a batcher's thread to start); statistics are reset afterwards.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from fate_edge.model.decoding_model import DecodingModel
    from fate_edge.runtime.batch import Batcher
    from fate_edge.runtime.scheduler import Scheduler

WARM_PROMPT = [0, 0]  # two rows: the prompt path; then one decode row


def warm_up(batcher: Batcher | None, scheduler: Scheduler, model: DecodingModel, lock: threading.Lock) -> bool:
    """Run a two-token prompt and one decode token through an engine's ``model`` on its batcher's thread, into a KV
    cache of their own, under the engine's step ``lock``, and forget them. Returns whether it ran (see the module's
    docstring for when)."""
    if batcher is None or not scheduler.all_at_hand:
        return False

    @torch.inference_mode()
    def tokens() -> None:
        with lock:  # the batcher's steps take the same lock
            cache = model.new_cache()
            cache.capacity_hint = len(WARM_PROMPT) + 1
            try:
                model(torch.tensor([WARM_PROMPT], device=model.device), cache, last_only=True)
                model(torch.tensor([WARM_PROMPT[:1]], device=model.device), cache, last_only=True)
            finally:
                scheduler.new_sequence()  # no pin, prediction or sequence statistic of these tokens is left
                scheduler.forget_stats()

    batcher.call(tokens)
    return True
