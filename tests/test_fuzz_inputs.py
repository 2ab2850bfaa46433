"""The fuzzer: seeded, bounded properties over damaged GGUF headers and tensor tables, config.json files and
safetensors headers, each example run through ``fate-edge convert`` in a child process under a memory and time
watchdog (tests/_fuzz_child.py). Every outcome is a store or one error line: never a traceback, a signal, more
than 1 GB or more than 30 s."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _gguf_writer import write_gguf

CHILD = Path(__file__).parent / "_fuzz_child.py"
EXAMPLES = int(os.environ.get("FATE_EDGE_FUZZ_EXAMPLES", "40"))
# each test's fuzzer: its kind and its seed
KINDS = {
    "test_damaged_gguf_headers_and_tensor_tables": ("gguf", 1),
    "test_damaged_config_json": ("config", 2),
    "test_damaged_safetensors_headers": ("safetensors", 3),
}


@pytest.fixture(scope="module")
def fuzzed(request, tmp_path_factory, bundled_dir) -> tuple[int, str, str]:
    """The selected tests' fuzzers, one after the other in one child (one interpreter with torch, hypothesis and
    fate-edge instead of one each; the watchdog restarts its count at every example) → (exit status, stdout,
    the tail of stdout and stderr). Each test finds its own ``FUZZ OK KIND`` line; a fuzzer that fails ends the
    child before the next."""
    selected = {item.name for item in request.session.items if item.module is request.module}
    args: list[str] = []
    for test, (kind, seed) in KINDS.items():
        if test in selected:
            root = tmp_path_factory.mktemp(kind)
            source = write_gguf(bundled_dir, root / "m.gguf", "Q4_0") if kind == "gguf" else bundled_dir
            (root / "work").mkdir()
            args += [kind, str(source), str(root / "work"), str(EXAMPLES), str(seed)]
    proc = subprocess.run([sys.executable, str(CHILD), *args], capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout, f"exit status {proc.returncode}\n" + (proc.stdout + proc.stderr)[-4000:]


def _fuzz(fuzzed: tuple[int, str, str], kind: str) -> None:
    status, stdout, tail = fuzzed
    ok = f"FUZZ OK {kind}\n"
    assert ok in stdout, tail
    # the child exited 0, or the failure belongs to a fuzzer started after this one held
    assert status == 0 or "FUZZ START" in stdout.split(ok, 1)[1], tail


@pytest.mark.slow
def test_damaged_gguf_headers_and_tensor_tables(fuzzed):
    _fuzz(fuzzed, "gguf")


@pytest.mark.slow
def test_damaged_config_json(fuzzed):
    _fuzz(fuzzed, "config")


@pytest.mark.slow
def test_damaged_safetensors_headers(fuzzed):
    _fuzz(fuzzed, "safetensors")
