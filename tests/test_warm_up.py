"""An engine that holds its model and batches requests runs tokens through the model at load, on its batcher's
thread (runtime.warm_up): the thread and its OpenMP team start there, and nothing of those tokens is left for the
first request to see (statistics, pins, answers)."""

import pytest

from fate_edge import Engine, GenerateConfig
from fate_edge.runtime.scheduler_stats import SchedulerStats
from fate_edge.runtime.warm_up import warm_up

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = GenerateConfig(max_tokens=12, ignore_eos=True)
PROMPT = "def fibonacci(n):"


def test_a_batched_engine_that_holds_its_model_warms_up_at_load_and_forgets_it():
    with Engine.load(prompt_cache=0) as batched, Engine.load(max_batch=1, prompt_cache=0) as alone:
        assert batched.scheduler.all_at_hand
        thread = batched.batcher._thread
        assert thread is not None and thread.is_alive()  # started at load by the warm-up, not by a request
        assert batched.scheduler.stats == SchedulerStats()  # the load's tokens are no request's
        assert batched.scheduler.layer_uses == {}
        assert not batched.scheduler.in_use  # nothing left pinned
        assert alone.batcher is None  # served alone: no batcher thread, no warm-up
        assert warm_up(alone.batcher, alone.scheduler, alone.model, alone._lock) is False
        first = [r.token for r in batched.stream(PROMPT, CFG)]
        assert first == [r.token for r in alone.stream(PROMPT, CFG)]
        assert batched.batcher._thread is thread  # the request ran on the thread the warm-up started
        assert batched.scheduler.stats.hits > 0  # and its statistics are its own
        # each layer let go of what it pinned (the scheduler's short path for a model cached whole)
        assert not batched.scheduler.in_use and all(e.pins == 0 for e in batched.cache.entries.values())
        assert batched.scheduler.stats.predictions == 0 and batched.scheduler.stats.predictions_skipped > 0


def test_an_engine_that_streams_experts_does_not_warm_up(baseline_store):
    """Under a budget that does not hold the model the warm-up would read experts no one asked for."""
    with Engine.load(baseline_store, memory_budget="2MB", policy="fate-edge", prompt_cache=0) as eng:
        assert not eng.scheduler.all_at_hand
        assert eng.batcher._thread is None  # no request yet, so no batcher thread
        assert warm_up(eng.batcher, eng.scheduler, eng.model, eng._lock) is False
        assert eng.batcher._thread is None
