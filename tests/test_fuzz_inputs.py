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


def _fuzz(kind: str, source: Path, work: Path, seed: int) -> None:
    work.mkdir()
    proc = subprocess.run(
        [sys.executable, str(CHILD), kind, str(source), str(work), str(EXAMPLES), str(seed)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0 and "FUZZ OK" in proc.stdout, tail


@pytest.mark.slow
def test_damaged_gguf_headers_and_tensor_tables(tmp_path, bundled_dir):
    _fuzz("gguf", write_gguf(bundled_dir, tmp_path / "m.gguf", "Q4_0"), tmp_path / "work", seed=1)


@pytest.mark.slow
def test_damaged_config_json(tmp_path, bundled_dir):
    _fuzz("config", bundled_dir, tmp_path / "work", seed=2)


@pytest.mark.slow
def test_damaged_safetensors_headers(tmp_path, bundled_dir):
    _fuzz("safetensors", bundled_dir, tmp_path / "work", seed=3)
