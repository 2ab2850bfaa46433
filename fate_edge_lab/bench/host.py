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


def kernel_paths() -> dict[str, str]:
    """Which instruction sets each side's kernels run here, which the CPU's flags alone do not say (FATE_EDGE_NATIVE
    can hold fate-edge to its AVX2 path, and a llama.cpp build may leave the CPU's AVX-512 out): fate-edge's int4
    kernel ("avx512-vnni", "avx2+avx-vnni", or why none) and the features llama.cpp was built with, as its system
    info lists them ("AVX2 FMA F16C ..."; empty where llama-cpp-python is not installed)."""
    from fate_edge.quant.native import native_isa, native_status

    try:
        import llama_cpp

        info = llama_cpp.llama_print_system_info().decode()
    except ImportError:
        info = ""
    return {"fate-edge": native_isa() or native_status()[1], "llama.cpp": built_features(info)}


def built_features(system_info: str) -> str:
    """The features llama.cpp's system info marks 1, in its order: "CPU : SSE3 = 1 | AVX512 = 0 | AVX2 = 1 |" →
    "SSE3 AVX2"."""
    on = [part.split("=")[0] for part in system_info.split("|") if part.strip().endswith("= 1")]
    return " ".join(name.split(":")[-1].strip() for name in on)


def load_average() -> list[float]:
    """The 1-, 5- and 15-minute load averages, to two decimals (a shared host's speed drifts with them)."""
    return [round(x, 2) for x in os.getloadavg()]
