"""A batched engine loads on a thread of its own (``runtime.load_threads``): its batcher thread must hold the
process's only OpenMP team, or libgomp throttles every team's spin-waiting and the bundled model decodes ~4x slower.
A thread's OpenMP helpers end with it."""

import os
import threading

import pytest
import torch

import fate_edge.runtime.engine as engine_module
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge.runtime.generate import GenerateConfig
from fate_edge.runtime.load_threads import in_own_thread


@pytest.fixture(scope="module")
def bundled_store(tmp_path_factory, bundled_dir):
    out = tmp_path_factory.mktemp("load-threads") / "tiny-int4"
    convert(bundled_dir, out, ConvertOptions.full(bits=4), progress=False)
    return out


def test_in_own_thread_returns_the_result_or_raises_the_error_of_another_thread():
    here = threading.get_ident()
    assert in_own_thread(threading.get_ident) != here

    def fail():
        raise ValueError("a damaged store")

    with pytest.raises(ValueError, match="a damaged store"):
        in_own_thread(fail)


INTERRUPTED_AS_THE_LOAD_ENDS = """
import os, signal, sys, time
from fate_edge.runtime.load_threads import exit_if_loading, in_own_thread

signal.signal(signal.SIGINT, signal.default_int_handler)  # a test run started with `&` hands it SIGINT ignored

def load():
    time.sleep(0.2)  # the caller waits in join() by now
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the load's last instant: the wait is interrupted...

try:
    in_own_thread(load)
except KeyboardInterrupt:
    time.sleep(0.2)  # ...and the load's thread has ended (in a real load, it may still be in torch's teardown)
    exit_if_loading(130)
    sys.exit(1)
"""


def test_a_wait_interrupted_as_the_load_ends_still_exits_at_once():
    """The interpreter's exit aborts a process whose load thread is still inside torch's thread teardown (CI saw
    SIGABRT, "terminate called without an active exception"): an interrupted wait exits at once, alive or not."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", INTERRUPTED_AS_THE_LOAD_ENDS], capture_output=True, timeout=60)
    assert done.returncode == 130, done.stderr


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
def test_the_openmp_helpers_of_a_finished_thread_are_gone():
    """Each run is a new thread with its own OpenMP team: helpers that outlived their thread would add threads at
    every run. The first run may start process-wide pools, and other tests' threads may come and go, so it takes
    one run in three that leaves the count as it found it."""
    before_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    x = torch.randn(512, 512)

    def work():
        return [x @ x for _ in range(20)]  # parallel regions with 2 threads

    try:
        in_own_thread(work)
        counts = []
        for _ in range(3):
            start = _threads()
            in_own_thread(work)
            counts.append(_threads() - start)
            if counts[-1] <= 0:
                break
        assert min(counts) <= 0, f"threads left behind per run: {counts}"
    finally:
        torch.set_num_threads(before_threads)


@pytest.mark.parametrize("max_batch, elsewhere", [(4, True), (0, True), (1, False)])
def test_a_batched_engine_loads_on_a_thread_of_its_own(bundled_store, monkeypatch, max_batch, elsewhere):
    """max_batch > 1 (or 0, the machine's default of 8): the batcher thread computes, so the load runs elsewhere;
    alone (1): the caller's thread computes, and loads."""
    seen = []
    real = engine_module.load_model

    def recording(*args, **kwargs):
        seen.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "load_model", recording)
    with Engine(EngineConfig(bundled_store, memory_budget="2MB", max_batch=max_batch)) as eng:
        assert (seen[0] != threading.get_ident()) == elsewhere
        assert (eng.batcher is not None) == (max_batch != 1)
        assert eng.generate_text("def f():", GenerateConfig(max_tokens=4))[0]  # it works after a load elsewhere


LOAD_IN_THE_MAIN_THREAD = """
import os, threading, time, torch
from fate_edge.runtime.engine import Engine

torch.set_num_threads(2)  # starts torch's other pool (pthreadpool's workers) before the count

def native():  # OS threads that are not Python's: OpenMP helpers (and the runtime's own)
    return len(os.listdir("/proc/self/task")) - threading.active_count()

before = native()
with Engine.load(threads=2) as eng:
    deadline = time.monotonic() + 10  # threads that ended (the probe's, a closed fetch engine's) leave the OS late
    while native() > before and time.monotonic() < deadline:
        time.sleep(0.1)
    fetchers = sum(t.name.startswith("fate-fetch") for t in threading.enumerate())
    # the warm-up (runtime.warm_up) started the batcher's thread at load: its team's helpers are the only ones
    team = torch.get_num_threads() - 1 if eng.batcher._thread is not None else 0
    print(fetchers == eng.fetch.workers, before + team, native(), eng.max_batch)  # no other model's readers left
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
def test_loading_a_batched_engine_leaves_the_callers_thread_without_openmp_helpers(tmp_path):
    """Everything a first load computes with several threads (converting the bundled model, the compute dtype's
    probe, the model, the batcher's KV slab zeroed by a parallel fill) runs on threads that end: a helper left to the
    caller's thread, or to one that lives on, would make the batcher's team the second one. A fresh cache, so that the
    conversion and the probe run too; the caller has computed nothing before, so it has no helpers of its own. The
    one team expected is the batcher's, whose thread the warm-up at load started."""
    import subprocess
    import sys

    env = {**os.environ, "FATE_EDGE_CACHE": str(tmp_path)}
    env.pop("FATE_EDGE_DTYPE", None)  # the suite's float32: "auto" probes a bf16 CPU's speed on a first load
    done = subprocess.run(
        [sys.executable, "-c", LOAD_IN_THE_MAIN_THREAD], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr[-800:]
    own_readers, expected, after, max_batch = done.stdout.split()[-4:]
    expected, after = int(expected), int(after)
    assert int(max_batch) > 1  # the batcher computes
    assert own_readers == "True"  # the probe's two models closed theirs
    assert after == expected, f"the load left {after - expected} native thread(s) behind: {done.stderr[-500:]}"
