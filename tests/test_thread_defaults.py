"""Thread defaults that hold up under load: a short OpenMP spin (GOMP_SPINCOUNT) or passive waiting, by the host's
load, before torch starts, and torch threads + fetch workers that fit the cores this process may use (mechanisms
only; speeds are bench_threads.py's job)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from fate_edge_lab.bench.llamacpp import OPENMP_DEFAULT, llama_child

OPENMP = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def _child_env(code: str, env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


PROBE = f"import json, os, fate_edge; print(json.dumps({{k: os.environ.get(k) for k in {OPENMP!r}}}))"


def _user_env(**set_by_user: str) -> dict[str, str]:
    drop = {*OPENMP, "FATE_EDGE_SET_OPENMP"}  # as a user's shell has them
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **set_by_user}


def test_openmp_waits_with_a_short_spin_on_a_quiet_host_and_passively_on_an_oversubscribed_one():
    from fate_edge import SHORT_SPINCOUNT, openmp_defaults

    # PASSIVE woke a sleeping thread for every small decode operator (3-4x slower on a quiet host); spinning
    # stole the core from the thread waited for once the host ran more tasks than cores (8x slower at load 16).
    for running in (None, 1):  # other tasks running now, or no /proc to say: the 1-minute load decides
        assert openmp_defaults(0.3, 2, running) == {"GOMP_SPINCOUNT": SHORT_SPINCOUNT}
        assert openmp_defaults(1.9, 2, running) == {"GOMP_SPINCOUNT": SHORT_SPINCOUNT}
        assert openmp_defaults(2.0, 2, running) == {"OMP_WAIT_POLICY": "PASSIVE"}
        assert openmp_defaults(16.0, 2, running) == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_with_nothing_else_running_idle_threads_spin_across_a_decode_layers_python():
    from fate_edge import QUIET_SPINCOUNT, SHORT_SPINCOUNT, openmp_defaults

    assert int(QUIET_SPINCOUNT) > int(SHORT_SPINCOUNT)
    assert openmp_defaults(0.3, 2, running_elsewhere=0) == {"GOMP_SPINCOUNT": QUIET_SPINCOUNT}
    # the 1-minute load still counts a benchmark's previous process (2 threads for 30 s: ~0.8) after it ended
    assert openmp_defaults(2.4, 2, running_elsewhere=0) == {"GOMP_SPINCOUNT": QUIET_SPINCOUNT}


def test_running_elsewhere_counts_a_busy_process_beside_this_one():
    from fate_edge import running_elsewhere

    quiet = running_elsewhere()
    assert quiet is not None and quiet >= 0
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert max(running_elsewhere() or 0 for _ in range(5)) >= 1  # the spinning child, whatever else runs
    finally:
        busy.kill()
        busy.wait()


@pytest.mark.slow
def test_importing_fate_edge_sets_one_of_the_two_and_names_it():
    from fate_edge import QUIET_SPINCOUNT, SHORT_SPINCOUNT

    keys = (*OPENMP, "FATE_EDGE_SET_OPENMP")
    code = f"import json, os, fate_edge; print(json.dumps({{k: os.environ.get(k) for k in {keys!r}}}))"
    got = _child_env(code, _user_env())
    assert got in (
        {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": QUIET_SPINCOUNT, "FATE_EDGE_SET_OPENMP": "GOMP_SPINCOUNT"},
        {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": SHORT_SPINCOUNT, "FATE_EDGE_SET_OPENMP": "GOMP_SPINCOUNT"},
        {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None, "FATE_EDGE_SET_OPENMP": "OMP_WAIT_POLICY"},
    )


@pytest.mark.parametrize(
    "user", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "5"}]
)
@pytest.mark.slow
def test_openmp_settings_the_user_made_are_kept_and_not_overridden(user):
    # libgomp lets GOMP_SPINCOUNT override the wait policy's spin, so ours must not join a user's policy
    assert _child_env(PROBE, _user_env(**user)) == {k: user.get(k) for k in OPENMP}


@pytest.mark.slow
def test_a_child_of_fate_edge_tells_our_spin_count_from_the_users_wait_policy():
    parent = subprocess.run(
        [sys.executable, "-c", "import json, os, fate_edge; print(json.dumps(dict(os.environ)))"],
        env=_user_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    inherited = json.loads(parent.stdout.strip().splitlines()[-1])
    ours = inherited["FATE_EDGE_SET_OPENMP"]
    assert ours in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY") and ours in inherited
    user = {"OMP_WAIT_POLICY": "ACTIVE"} if ours == "GOMP_SPINCOUNT" else {"GOMP_SPINCOUNT": "5"}
    # the user's own setting beside our inherited one: ours goes, theirs stays alone
    assert _child_env(PROBE, {**inherited, **user}) == {k: user.get(k) for k in OPENMP}


PEER_PROBE = OPENMP_DEFAULT + f"import json; print(json.dumps({{k: os.environ.get(k) for k in {OPENMP!r}}}))"


@pytest.mark.slow
def test_llama_cpp_children_start_with_its_own_openmp_default_unless_the_user_chose_one():
    # fate_edge's former PASSIVE made llama.cpp (its own libgomp) 20x slower: the peer gets libgomp's default back
    assert _child_env(PEER_PROBE, _user_env()) == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None}
    # also as a child of a fate_edge process, which inherits our settings with their marker,
    parent = subprocess.run(
        [sys.executable, "-c", "import json, os, fate_edge; print(json.dumps(dict(os.environ)))"],
        env=_user_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    inherited = json.loads(parent.stdout.strip().splitlines()[-1])
    assert _child_env(PEER_PROBE, inherited) == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None}
    # but a value the user set is the user's.
    assert _child_env(PEER_PROBE, _user_env(OMP_WAIT_POLICY="PASSIVE"))["OMP_WAIT_POLICY"] == "PASSIVE"


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
@pytest.mark.slow
def test_a_llama_cpp_child_loads_llama_cpps_libgomp_before_torch_does():
    # torch bundles a libgomp with the system's soname: whichever loads first serves both, with its wait policy.
    code = llama_child(
        "import json, fate_edge, torch\n"
        "maps = {l.split()[-1] for l in open('/proc/self/maps') if 'libgomp' in l}\n"
        "print(json.dumps({'libgomp': sorted(maps)}))"
    )
    (lib,) = _child_env(code, _user_env())["libgomp"]
    assert "/torch/" not in lib
