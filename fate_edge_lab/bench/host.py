"""What every measurement records about the host it ran on: the CPU's model name, the instruction sets that decide
which kernels run (a "Intel Xeon" or "AMD EPYC" name alone does not say whether AVX-512 VNNI is there), and the
load average."""

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


# The flags (as /proc/cpuinfo spells them) that pick or shape a kernel here or in llama.cpp, in this order.
SIMD_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512vbmi",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)


def cpu_flags(cpuinfo: str | None = None) -> list[str]:
    """The :data:`SIMD_FLAGS` the CPU reports (``cpuinfo``: /proc/cpuinfo's text; read here when None), in that
    order; [] where there is no flags line."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return []
    line = next((ln for ln in cpuinfo.splitlines() if ln.startswith("flags")), "")
    have = set(line.split(":", 1)[1].split()) if ":" in line else set()
    return [f for f in SIMD_FLAGS if f in have]


def cpu_label() -> str:
    """The CPU's model name and its :func:`cpu_flags`, as tables print it: "AMD EPYC (avx2 fma ... avx512_bf16)"."""
    flags = cpu_flags()
    return f"{cpu_model() or 'unknown CPU'}" + (f" ({' '.join(flags)})" if flags else "")


def load_average() -> list[float]:
    """The 1-, 5- and 15-minute load averages, to two decimals (a shared host's speed drifts with them)."""
    return [round(x, 2) for x in os.getloadavg()]
