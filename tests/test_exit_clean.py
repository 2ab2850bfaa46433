"""An engine never kills its process: a script that exits without close() or ``with`` ends with status 0.

Before exit_close, a stream left open (the batcher thread mid-step at interpreter exit) ended every run with
"terminate called without an active exception" and status 134 (SIGABRT).
"""

import os
import subprocess
import sys

# one request served, then a stream left open: the batcher thread is mid-step when the interpreter exits
SCRIPT = """
from fate_edge import Engine
from fate_edge.sdk import generate, stream
e = Engine.load(memory_budget="8MB", threads=1)
print("text", repr(generate(e, "def f():", max_tokens=4).text))
s = stream(e, "def f():", max_tokens=200)
print("token", repr(next(s).text))
"""


def test_script_without_close_exits_cleanly():
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=os.environ.copy()
    )
    assert done.returncode == 0, f"status {done.returncode}: {done.stderr[-400:]}"
    assert "terminate called" not in done.stderr
    assert done.stdout.startswith("text ") and "token " in done.stdout


# an engine made inside a function and dropped with its stream unfinished: collected, never closed
DROPPED = """
import gc, threading, weakref
from fate_edge import Engine
from fate_edge.sdk import stream
refs = []
def first_tokens():
    e = Engine.load(memory_budget="8MB", threads=1)
    refs.append(weakref.ref(e))
    s = stream(e, "def f():", max_tokens=200)
    return [next(s).text for _ in range(3)]
print("tokens", len(first_tokens()))
gc.collect()
print("engine", "alive" if refs[0]() is not None else "gone")
print("threads", sorted(t.name for t in threading.enumerate() if t.name != "MainThread"))
"""


def test_an_engine_dropped_unclosed_stops_its_threads_and_exits_cleanly():
    done = subprocess.run(
        [sys.executable, "-c", DROPPED], capture_output=True, text=True, timeout=120, env=os.environ.copy()
    )
    assert done.returncode == 0, f"status {done.returncode}: {done.stderr[-400:]}"
    assert "terminate called" not in done.stderr
    assert "tokens 3" in done.stdout and "engine gone" in done.stdout
    assert "threads []" in done.stdout, done.stdout  # no batcher or fetch thread left holding the model
