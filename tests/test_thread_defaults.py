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


def _user_env(**set_by_user: str) -> dict[str, str]:
    drop = {"OMP_WAIT_POLICY", "FATE_EDGE_SET_OMP_WAIT_POLICY"}  # as a user's shell has them
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **set_by_user}


def test_importing_fate_edge_sets_passive_wait_policy():
    assert _child_env(PROBE, _user_env())["omp"] == "PASSIVE"


def test_a_wait_policy_the_user_set_is_kept():
    assert _child_env(PROBE, _user_env(OMP_WAIT_POLICY="ACTIVE"))["omp"] == "ACTIVE"


PEER_PROBE = ("import json, os, fate_edge; from fate_edge.bench.llamacpp import llama_cpp_environment; "
              "llama_cpp_environment(); print(json.dumps({'omp': os.environ.get('OMP_WAIT_POLICY')}))")


def test_llama_cpp_starts_with_its_own_openmp_default_unless_the_user_chose_one():
    # fate_edge's PASSIVE made llama.cpp (its own libgomp) 20x slower: the peer gets libgomp's default back,
    assert _child_env(PEER_PROBE, _user_env())["omp"] is None
    # also in a child of a fate_edge process, which inherits our PASSIVE with its marker,
    parent = subprocess.run([sys.executable, "-c", "import json, os, fate_edge; print(json.dumps(dict(os.environ)))"],
                            env=_user_env(), capture_output=True, text=True, check=True)
    inherited = json.loads(parent.stdout.strip().splitlines()[-1])
    assert inherited["OMP_WAIT_POLICY"] == "PASSIVE"
    assert _child_env(PEER_PROBE, inherited)["omp"] is None
    # but a value the user set is the user's.
    assert _child_env(PEER_PROBE, _user_env(OMP_WAIT_POLICY="PASSIVE"))["omp"] == "PASSIVE"


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
