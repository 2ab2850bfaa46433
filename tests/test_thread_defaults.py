"""Thread defaults that hold up under load: OMP_WAIT_POLICY=PASSIVE before torch starts, and torch threads +
fetch workers that fit the cores this process may use (mechanisms only; speeds are bench_threads.py's job)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from fate_edge.devices.detect import available_cores, thread_split


def _child_env(code: str, env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


PROBE = "import json, os, fate_edge; print(json.dumps({'omp': os.environ.get('OMP_WAIT_POLICY')}))"


def test_importing_fate_edge_sets_passive_wait_policy():
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert _child_env(PROBE, env)["omp"] == "PASSIVE"


def test_a_wait_policy_the_user_set_is_kept():
    env = {**os.environ, "OMP_WAIT_POLICY": "ACTIVE"}
    assert _child_env(PROBE, env)["omp"] == "ACTIVE"


@pytest.mark.parametrize("cores", [1, 2, 3, 4, 5, 8, 16, 64])
def test_split_never_exceeds_the_cores(cores):
    torch_threads, workers = thread_split(cores)
    assert torch_threads >= 1 and workers >= 1
    assert torch_threads + workers <= max(cores, 2)  # one of each at least, even on one core
    if cores >= 2:
        assert torch_threads + workers == cores  # and no core left idle


def test_defaults_follow_this_process_affinity():
    """Restricted to one CPU (as taskset or a container does), the defaults count one core, not the host's."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no sched_setaffinity on this platform")
    code = ("import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}); import json; "
            "from fate_edge import defaults; from fate_edge.fetch import BufferPool, FetchEngine; "
            "e = FetchEngine(BufferPool(1, 4096)); print(json.dumps({'threads': defaults.THREADS, "
            "'workers': e.workers, 'cores': len(os.sched_getaffinity(0))})); e.close()")
    got = _child_env(code, dict(os.environ))
    assert got == {"threads": 1, "workers": 1, "cores": 1}


def test_this_process_split_fits_its_cores():
    from fate_edge import defaults

    assert (defaults.THREADS, defaults.FETCH_WORKERS) == thread_split(available_cores())
