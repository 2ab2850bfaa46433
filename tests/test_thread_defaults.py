"""Thread defaults that hold up under load: OMP_WAIT_POLICY=PASSIVE before torch starts, and torch threads +
fetch workers that fit the cores this process may use (mechanisms only; speeds are bench_threads.py's job)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from fate_edge.bench.llamacpp import OPENMP_DEFAULT, llama_child


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


PEER_PROBE = OPENMP_DEFAULT + "import json; print(json.dumps({'omp': os.environ.get('OMP_WAIT_POLICY')}))"


def test_llama_cpp_children_start_with_its_own_openmp_default_unless_the_user_chose_one():
    # fate_edge's PASSIVE made llama.cpp (its own libgomp) 20x slower: the peer gets libgomp's default back
    assert _child_env(PEER_PROBE, _user_env())["omp"] is None
    # also as a child of a fate_edge process, which inherits our PASSIVE with its marker,
    parent = subprocess.run([sys.executable, "-c", "import json, os, fate_edge; print(json.dumps(dict(os.environ)))"],
                            env=_user_env(), capture_output=True, text=True, check=True)
    inherited = json.loads(parent.stdout.strip().splitlines()[-1])
    assert inherited["OMP_WAIT_POLICY"] == "PASSIVE"
    assert _child_env(PEER_PROBE, inherited)["omp"] is None
    # but a value the user set is the user's.
    assert _child_env(PEER_PROBE, _user_env(OMP_WAIT_POLICY="PASSIVE"))["omp"] == "PASSIVE"


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_a_llama_cpp_child_loads_llama_cpps_libgomp_before_torch_does():
    # torch bundles a libgomp with the system's soname: whichever loads first serves both, with its wait policy.
    code = llama_child("import json, fate_edge, torch\n"
                       "maps = {l.split()[-1] for l in open('/proc/self/maps') if 'libgomp' in l}\n"
                       "print(json.dumps({'libgomp': sorted(maps)}))")
    (lib,) = _child_env(code, _user_env())["libgomp"]
    assert "/torch/" not in lib
