"""``fate-edge demo`` and ``fate-edge chat`` end to end, in subprocesses (stdin and stdout are pipes, not a TTY)."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("fe-demo")
    return dict(os.environ, FATE_EDGE_CACHE=str(cache), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _fate_edge(args, env, **kw):
    return subprocess.run(
        [sys.executable, "-m", "fate_edge", *args], env=env, capture_output=True, text=True, timeout=180, cwd=ROOT, **kw
    )


@pytest.mark.slow
def test_demo_converts_once_compares_policies_and_is_quick(env):
    t0 = time.monotonic()
    proc = _fate_edge(["demo", "--max-tokens", "24"], env)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "converting it to an expert store" in out  # fresh cache dir: converted in this run
    assert any(Path(env["FATE_EDGE_CACHE"], "stores").iterdir())
    assert "--- fate-edge ---" in out and "--- load-on-demand ---" in out
    for row in ("decode tokens/s", "bytes read / token", "expert hit rate", "expert memory held", "process peak RSS"):
        assert row in out, row
    m = re.search(r"fate-edge: ([0-9.]+)x the tokens/s of load-on-demand, ([0-9.]+)x fewer bytes read per token", out)
    assert m and float(m.group(2)) > 1.0, out  # caching and int4 read fewer bytes than bf16 on demand
    held = re.search(r"expert memory held\s+([0-9.]+) MB <= ([0-9.]+) MB", out)
    assert held and float(held.group(1)) <= float(held.group(2))
    assert wall < 60
    again = _fate_edge(["demo", "--max-tokens", "4", "--link", "none"], env)
    assert again.returncode == 0 and "converting" not in again.stdout  # the store is reused


@pytest.mark.slow
def test_demo_refuses_a_budget_below_the_minimum(env):
    proc = _fate_edge(["demo", "--memory-budget", "10KB"], env)
    assert proc.returncode == 2
    assert "below the minimum" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_chat_reads_piped_stdin_with_commands(env):
    script = "def add(a, b):\n/stats\n/reset\nhello\n/exit\nnever sent\n"
    proc = _fate_edge(["chat", "--memory-budget", "2MB", "--max-tokens", "8", "--ignore-eos"], env, input=script)
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    assert err.count("tok/s") == 2 and "hit rate" in err and "RSS" in err  # a status line per answer
    assert "expert uses" in err and "conversation: 1 turns" in err  # /stats
    assert "(conversation cleared)" in err
    assert len([line for line in proc.stdout.splitlines() if line.strip()]) >= 1
