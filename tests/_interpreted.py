"""A Triton test's script in a process of its own, under Triton's interpreter (or compiled for the GPU): Triton reads
TRITON_INTERPRET when triton.language is imported, which another test (or torch) may have done in this one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch


def run_child(script: str, tmp_path: Path, *args: object, interpret: bool = True, timeout: int = 300) -> object:
    """``script`` run as ``python -c script ARGS... OUT`` → what it saved to OUT (``tmp_path / "out.pt"``)."""
    out = tmp_path / "out.pt"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | (
        {"TRITON_INTERPRET": "1"} if interpret else {}
    )
    run = subprocess.run(
        [sys.executable, "-c", script, *map(str, args), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(out, weights_only=False)
