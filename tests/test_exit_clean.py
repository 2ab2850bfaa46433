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
