"""Per-head matrix-vector products over bf16 and fp16 weights on the CPU, in fate-edge's own kernel
(``native/head_matvec.c``), for MLA's absorbed decode (``mla.attend``).

torch multiplies each head's block of ``kv_b_proj`` by a vector as a batched bf16 GEMM, which CPUs without
AVX512-BF16 emulate slowly (docs/measured-choices.md). The kernel
reads each weight once in its own dtype and computes in fp32. Built on first use like the other kernels
(:mod:`fate_edge.native_build`); without a compiler or AVX2, or with ``FATE_EDGE_NATIVE=0``, :func:`takes` is False
and the caller uses torch.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from fate_edge.native_build import LazyKernel

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _setup(lib: ctypes.CDLL) -> str | None:
    if not lib.fe_head_matvec_supported():
        return "this CPU lacks AVX2, FMA or F16C"
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.fe_head_matvec.restype = i32
    argtypes: list[Any] = [i32, ptr, i32, i32, i32, i32, ptr, i32, i64, i64, ptr, i32]
    lib.fe_head_matvec.argtypes = argtypes
    return None


_kernel = LazyKernel("fate_edge.model", "head_matvec.c", "head_matvec", "head matvec kernel", _setup)
available = _kernel.available  # (usable here, why not)


def takes(w: torch.Tensor) -> bool:
    """Whether the kernel multiplies by ``w`` [heads, rows, cols]: bf16 or fp16 on the CPU, columns contiguous and a
    multiple of 8."""
    return (
        w.device.type == "cpu"
        and w.dtype in (torch.bfloat16, torch.float16)
        and w.dim() == 3
        and w.stride(2) == 1
        and w.shape[2] % 8 == 0
        and available()[0]
    )


def x_w(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per head ``x[..., h, :] @ w[h]``: x [heads, rows] or [vectors, heads, rows], w [heads, rows, cols] → x's
    leading shape with cols, fp32 (the weights read once for every vector)."""
    return _call(0, x, w, w.shape[2])


def w_x(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per head ``w[h] @ x[..., h, :]``: x [heads, cols] or [vectors, heads, cols], w [heads, rows, cols] → x's
    leading shape with rows, fp32."""
    return _call(1, x, w, w.shape[1])


def _call(mode: int, x: torch.Tensor, w: torch.Tensor, width: int) -> torch.Tensor:
    heads, rows, cols = w.shape
    x = x.to(torch.float32).contiguous()
    if x.dim() not in (2, 3) or x.shape[-2:] != (heads, rows if mode == 0 else cols):
        raise ValueError(f"head matvec: x {tuple(x.shape)} does not fit w {tuple(w.shape)}")
    vectors = x.shape[0] if x.dim() == 3 else 1
    # on x's device, whatever the default device is (under ``torch.device("meta")`` a bare empty() would hand the
    # kernel a tensor without storage to write into)
    out = torch.empty(*x.shape[:-1], width, dtype=torch.float32, device=x.device)
    rc = _kernel.lib.fe_head_matvec(
        mode,
        x.data_ptr(),
        vectors,
        heads,
        rows,
        cols,
        w.data_ptr(),
        _DTYPES[w.dtype],
        w.stride(0),
        w.stride(1),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"head matvec: the kernel does not take w {tuple(w.shape)} with strides {w.stride()}")
    return out
