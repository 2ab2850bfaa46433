"""The CPU kernels every decode calls, built (first use on a machine) and loaded when a model loads, not inside its
first request: each load asks the compiler its version and opens a shared library, a few milliseconds of the first
prompt otherwise (llama.cpp runs a warm-up pass at load for the same reason)."""

from __future__ import annotations

from fate_edge.model import decode_attention, head_matvec, native_router, row_ops


def warm_native_kernels() -> None:
    """Load the row, attention, head and router kernels now; one that cannot run here (no compiler, another CPU,
    ``FATE_EDGE_NATIVE=0``) is left to torch's operators as before, and says why when it is asked."""
    for kernel in (row_ops, decode_attention, head_matvec, native_router):
        kernel.available()
