"""Decode attention on the CPU over bf16 and fp16 caches, in fate-edge's own kernel (``native/decode_attention.c``).

torch's CPU attention computes a bf16 decode query with bf16 GEMMs, which CPUs without AVX512-BF16 emulate several
times slower than fp32 (docs/measured-choices.md), so a bf16 model's decode slowed with its context far faster than
its cache grew. The kernel reads the cache once in
its own dtype and computes in fp32. fp32 attention stays on torch (as fast, and its bits are what the fp32 parity and
batching tests pin). Built on first use like the int4 kernel (:mod:`fate_edge.native_build`); without a compiler or
AVX2, or with ``FATE_EDGE_NATIVE=0``, :func:`available` is False and callers use torch.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from fate_edge.native_build import LazyKernel

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
NATIVE_DTYPES = (torch.bfloat16, torch.float16)  # the cache dtypes this kernel serves by default


def _setup(lib: ctypes.CDLL) -> str | None:
    if not lib.fe_attention_supported():
        return "this CPU lacks AVX2, FMA or F16C"
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.fe_decode_attention.restype = ctypes.c_int
    argtypes: list[Any] = (
        [ptr, ctypes.c_int, ptr, ptr, ctypes.c_int]  # q, its dtype, k, v, their dtype
        + [i64] * 6  # k strides (sequence, head, position), v strides
        + [ptr, ptr, i64]  # first position and length per row (or NULL, NULL, every row's length)
        + [ctypes.c_int] * 5  # rows, q heads, kv heads, Dk, Dv
        + [ctypes.c_float, ptr, ctypes.c_int]  # scale, out, threads
        + [ptr]  # attention sinks, float32 per query head (gpt-oss), or NULL
    )
    lib.fe_decode_attention.argtypes = argtypes
    lib.fe_attention_set_isa.argtypes = [ctypes.c_int]
    lib.fe_attention_set_isa.restype = ctypes.c_int
    return None


_kernel = LazyKernel("fate_edge.model", "decode_attention.c", "decode_attention", "attention kernel", _setup)
available = _kernel.available  # (usable here, why not)


def use_isa(isa: int) -> int:
    """Hold the kernel to an instruction set (2: AVX-512, 1: AVX2), for tests and benchmarks that compare the two
    paths; returns the one it uses now (at most this CPU's)."""
    return int(_kernel.lib.fe_attention_set_isa(isa))


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtypes: tuple[torch.dtype, ...] = NATIVE_DTYPES) -> bool:
    """Whether :func:`attend` computes ``q`` [B, Hq, 1, Dk] over ``k``/``v`` [B, Hkv, L, D] (torch's layout)."""
    return (
        q.dim() == k.dim() == v.dim() == 4
        and q.shape[2] == 1
        and k.shape[0] == v.shape[0] == q.shape[0]
        and k.shape[2] == v.shape[2] > 0
        and _fits(q, k, v, q.shape[1], k.shape[1], dtypes)
    )


def takes_ranges(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`attend_ranges` computes ``q`` [R, Hq, Dk] over one cache ``k``/``v`` [Hkv, C, D]."""
    return (
        q.dim() == 3
        and k.dim() == v.dim() == 3
        and k.shape[1] == v.shape[1]
        and _fits(q, k, v, q.shape[1], k.shape[0], NATIVE_DTYPES)
    )


def _fits(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hq: int, hkv: int, dtypes: tuple[torch.dtype, ...]
) -> bool:
    """Device, dtypes, heads (``hq`` query heads over ``hkv``) and head sizes (the last dimension) the kernel takes."""
    return (
        q.device.type == "cpu"
        and q.dtype in dtypes
        and k.dtype == v.dtype == q.dtype
        and k.shape[-3] == v.shape[-3] == hkv > 0
        and hq % hkv == 0
        and q.shape[-1] == k.shape[-1]
        and q.shape[-1] % 8 == 0
        and v.shape[-1] % 8 == 0
        and k.stride(-1) == 1
        and v.stride(-1) == 1
        and available()[0]
    )


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` for one query position per sequence: q [B, Hq, 1, Dk], k/v [B, Hkv, L, D]
    (strided views of a cache are read in place) → [B, Hq, 1, Dv] in q's dtype. ``sinks`` [Hq]: gpt-oss's attention
    sinks, one more logit per head in the softmax's denominator. Check :func:`takes` first."""
    b, hq, _, dk = q.shape
    return _call(q.reshape(b, hq, dk), k, v, None, k.shape[2], scale, sinks).view(b, hq, 1, -1)


def attend_ranges(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows of queries q [R, Hq, Dk] over ranges of one cache k/v [Hkv, C, D]: row r attends to positions
    ``starts[r] .. starts[r] + lengths[r] - 1`` (int64 tensors on the CPU) → [R, Hq, Dv] (``sinks``: as
    :func:`attend`)."""
    k, v = k.unsqueeze(0).expand(q.shape[0], -1, -1, -1), v.unsqueeze(0).expand(q.shape[0], -1, -1, -1)
    return _call(q, k, v, (starts, lengths), 0, scale, sinks)  # expanded: every row's sequence stride is 0


def _call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ranges: tuple[torch.Tensor, torch.Tensor] | None,
    length: int,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    q = q.contiguous()
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
        assert sinks.shape == (q.shape[1],), f"sinks {tuple(sinks.shape)} for {q.shape[1]} query heads"
    r, hq, _ = q.shape
    out = torch.empty(r, hq, v.shape[3], dtype=q.dtype, device=q.device)
    _launch(q.data_ptr(), q.dtype, r, hq, k, v, ranges, length, scale, out.data_ptr(), sinks)
    return out


def attend_at(q: int, hq: int, k: torch.Tensor, v: torch.Tensor, length: int, scale: float, out: int) -> None:
    """:func:`attend` on addresses for one query row: ``hq`` heads of bf16 q [hq, Dk] at ``q`` over the first
    ``length`` positions of one sequence's caches ``k``/``v`` [1, Hkv, positions, D] (read in place, their own
    strides) → bf16 [hq, Dv] at ``out``. Unchecked: the caller checked the shapes once (:func:`takes` would take
    them) and holds q and out alive (``attention_row``)."""
    _launch(q, torch.bfloat16, 1, hq, k, v, None, length, scale, out, None)


def _launch(
    q: int,
    q_dtype: torch.dtype,
    rows: int,
    hq: int,
    k: torch.Tensor,
    v: torch.Tensor,
    ranges: tuple[torch.Tensor, torch.Tensor] | None,
    length: int,
    scale: float,
    out: int,
    sinks: torch.Tensor | None,
) -> None:
    """The kernel on ``rows`` query rows of ``hq`` heads at ``q`` (contiguous, ``q_dtype``) over k/v [B, Hkv, L, D]
    by their strides, into ``out`` [rows, hq, Dv] (q's dtype); raises where it fails."""
    rc = _kernel.lib.fe_decode_attention(
        q,
        _DTYPES[q_dtype],
        k.data_ptr(),
        v.data_ptr(),
        _DTYPES[k.dtype],
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        ranges[0].data_ptr() if ranges is not None else None,
        ranges[1].data_ptr() if ranges is not None else None,
        length,
        rows,
        hq,
        k.shape[1],
        k.shape[3],
        v.shape[3],
        scale,
        out,
        torch.get_num_threads(),
        sinks.data_ptr() if sinks is not None else None,
    )
    if rc == -2:
        raise MemoryError(f"decode attention over {k.shape[2]} cached positions: out of memory for its scratch")
    if rc != 0:
        q_shape = (rows, hq, k.shape[3])
        raise ValueError(f"decode attention: the kernel does not take q {q_shape} over k {tuple(k.shape)}")
