"""What every measurement records about the host it ran on: the CPU's model name and the load average."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it ("" where it does not)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")


def load_average() -> list[float]:
    """The 1-, 5- and 15-minute load averages, to two decimals (a shared host's speed drifts with them)."""
    return [round(x, 2) for x in os.getloadavg()]
