"""A decode row's small steps between its matmuls in one native call each (``native/row_ops.c``): a MoE layer's
expert sum into the residual, rope on q and k, RMSNorm and an int8 embedding row, with the bits of the torch
operators they replace.

Why: in a decode step each operator between two native matmuls starts with cold caches (the matmul streamed tens of
MB through them) and costs tens of microseconds; the expert sum was seven operators a layer, rope three, RMSNorm
eight inside its composite (docs/cpu-profile.md). Built on first use like the other kernels
(:mod:`fate_edge.native_build`); without a compiler, AVX2 and FMA, or with ``FATE_EDGE_NATIVE=0``, :func:`available`
is False and callers keep torch's operators.
"""

from __future__ import annotations

import array
import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeGuard, runtime_checkable

import torch

from fate_edge.native_build import LazyKernel

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _setup(lib: ctypes.CDLL) -> str | None:
    if not lib.fe_row_ops_supported():
        return "this CPU lacks AVX2 or FMA"
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.fe_moe_combine.restype = None
    combine: list[Any] = [ptr, i32, i64, i32, ptr, i32, ptr, ptr, i32, ptr, i32, ptr]
    lib.fe_moe_combine.argtypes = combine
    lib.fe_argmax_bf16.restype = i64
    lib.fe_argmax_bf16.argtypes = [ptr, i64]
    lib.fe_embed_int8_row.restype = i32
    lib.fe_embed_int8_row.argtypes = [i32, i64, i64, i64, ptr, i32]
    lib.fe_rms_norm_bf16.restype = i32
    lib.fe_rms_norm_bf16.argtypes = [ptr, i64, ptr, ctypes.c_float, ptr]
    lib.fe_rope_bf16.restype = i32
    lib.fe_rope_bf16.argtypes = [ptr, i32, i32, ptr, ptr, ptr, i64]
    lib.fe_head_norm_bf16.restype = i32
    lib.fe_head_norm_bf16.argtypes = [ptr, i32, i32, i64, ptr, ptr, ctypes.c_float]
    lib.fe_kv_append.restype = None
    lib.fe_kv_append.argtypes = [ptr, ptr, i64, i64, ptr, i64, ptr, i64]
    return None


_kernel = LazyKernel("fate_edge.model", "row_ops.c", "row_ops", "row kernel", _setup)
available = _kernel.available  # (usable here, why not)


def _row(t: torch.Tensor, n: int) -> bool:
    return t.device.type == "cpu" and t.dtype in _DTYPES and t.numel() == n and t.is_contiguous()


def add_experts(
    x: torch.Tensor,
    ys: list[torch.Tensor],
    weights: list[float],
    shared: tuple[torch.Tensor, torch.Tensor | None] | None,
) -> bool:
    """One row's MoE sum into the residual ``x`` [1, H] in place, as ``add_routed`` for each of ``ys`` (in order,
    times ``weights``), ``add_shared`` of ``shared`` (its output and Qwen's gate logit, or None) and ``add_moe``
    compute it from ``moe_sum(x)`` → True; False (nothing done) where the kernel does not take these tensors."""
    n = x.numel()
    z, gate = shared if shared is not None else (None, None)
    if (
        not ys
        or not _row(x, n)
        or not all(_row(y, n) and y.dtype == ys[0].dtype for y in ys)
        or (z is not None and not _row(z, n))
        or not available()[0]
    ):
        return False
    s = None
    if gate is not None:  # add_shared's sigmoid, in the gate's dtype (torch's, whose exp the kernel does not copy)
        s = torch.sigmoid(gate)
        if not _row(s, 1):
            return False
    _combine(
        x,
        [y.data_ptr() for y in ys],
        _DTYPES[ys[0].dtype],
        weights,
        (z.data_ptr(), _DTYPES[z.dtype]) if z is not None else (None, 0),
        (s.data_ptr(), _DTYPES[s.dtype]) if s is not None else (None, 0),
        None,
    )
    return True


def _combine(
    x: torch.Tensor,
    ys: list[int],
    y_dtype: int,
    weights: list[float],
    shared: tuple[int | None, int],
    gate: tuple[int | None, int],
    sigmoid: int | None,
) -> None:
    """``fe_moe_combine`` into ``x``: expert rows at the addresses ``ys`` (kernel dtype ``y_dtype``) times
    ``weights``, the shared expert's row and its gate as (address or None, kernel dtype), ``sigmoid``: the table's
    address where the gate is a logit."""
    table = array.array("q", ys)
    ws = array.array("f", weights)
    _kernel.lib.fe_moe_combine(
        x.data_ptr(),
        _DTYPES[x.dtype],
        x.numel(),
        len(ys),
        table.buffer_info()[0],
        y_dtype,
        ws.buffer_info()[0],
        *shared,
        *gate,
        sigmoid,
    )


_sigmoid_table: list[torch.Tensor] = []


def sigmoid_table() -> torch.Tensor:
    """torch's bf16 ``sigmoid`` of every bf16 value as int16 bits, indexed by the input's bits: Qwen's shared-expert
    gate in :func:`add_expert_rows` has torch's bits by construction. torch's bf16 sigmoid of a number is the same
    wherever it sits in a tensor, a one-element tensor included; a NaN's payload is not (the vector loop keeps its
    sign), so the NaNs are each computed alone, as the decode step's one gate is (tests/test_fused_row.py)."""
    if not _sigmoid_table:
        every = torch.arange(65536, dtype=torch.int32, device="cpu").to(torch.int16).view(torch.bfloat16)
        table = torch.sigmoid(every)
        for i in torch.isnan(every).nonzero().flatten().tolist():
            table[i] = torch.sigmoid(every[i : i + 1].clone())[0]
        _sigmoid_table.append(table.view(torch.int16).contiguous())
    return _sigmoid_table[0]


def add_expert_rows(x: torch.Tensor, ys: list[int], weights: list[float], shared: int, gate: int | None) -> bool:
    """:func:`add_experts` on addresses: bf16 expert rows of ``x.numel()`` values at ``ys`` (in order, times
    ``weights``), the shared expert's bf16 row at ``shared`` times the sigmoid of Qwen's bf16 gate logit at ``gate``
    (None: no gate), into a contiguous bf16 CPU row ``x`` in place → True; False (nothing done) where the kernel does
    not take ``x``. Unchecked addresses: the caller holds the rows alive (``grouped_experts.FusedRow``)."""
    if not ys or not _row(x, x.numel()) or x.dtype != torch.bfloat16 or not available()[0]:
        return False
    bf16 = _DTYPES[torch.bfloat16]
    table = sigmoid_table().data_ptr() if gate is not None else None
    _combine(x, ys, bf16, weights, (shared, bf16), (gate, bf16), table)
    return True


def argmax_bf16(logits: torch.Tensor) -> int | None:
    """``int(torch.argmax(logits))`` for contiguous bf16 CPU logits (a NaN counts as largest), or None where the
    kernel does not take them."""
    if logits.dtype != torch.bfloat16 or logits.device.type != "cpu" or not logits.is_contiguous():
        return None
    if not logits.numel() or not available()[0]:
        return None
    return int(_kernel.lib.fe_argmax_bf16(logits.data_ptr(), logits.numel()))


@runtime_checkable
class FileTable(Protocol):
    """A table stored row after row in an open file (``fate_edge.format.file_rows.FileRows``, which this layer does
    not import)."""

    path: Path
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def fd(self) -> int: ...


_FILE_TABLE_TYPES: dict[type, bool] = {}


def is_file_table(obj: object) -> TypeGuard[FileTable]:
    """``isinstance(obj, FileTable)``, asked once per type: a runtime protocol's check walks its members on every
    call (twice a decode token; docs/measured-choices.md), and a table's type (a dataclass) has them on every instance
    or on none."""
    known = _FILE_TABLE_TYPES.get(type(obj))
    if known is None:
        known = _FILE_TABLE_TYPES[type(obj)] = isinstance(obj, FileTable)
    return known


def embed_int8_row(codes: FileTable, scale: FileTable, row: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Row ``row`` of an int8 embedding table read by row from its store (``codes`` int8 [V, H], ``scale`` bf16 [V])
    and dequantized to ``dtype`` [1, H], with the bits of ``QuantizedEmbedding``'s gather, or None where the kernel
    does not take it. A row past the table raises IndexError, a short read OSError, as ``FileRows.gather``."""
    v, h = codes.shape[0], codes.shape[-1]
    if (
        codes.dtype != torch.int8
        or scale.dtype != torch.bfloat16
        or len(codes.shape) != 2
        or tuple(scale.shape) != (v,)
        or dtype not in _DTYPES
        or h > 16384
        or not available()[0]
    ):
        return None
    if not 0 <= row < v:
        raise IndexError(f"row ids must be in [0, {v}), got {row}")
    out = torch.empty(1, h, dtype=dtype, device="cpu")  # whatever the default device is (the read is the host's)
    rc = _kernel.lib.fe_embed_int8_row(
        codes.fd, codes.offset + row * h, scale.offset + row * 2, h, out.data_ptr(), _DTYPES[dtype]
    )
    if rc != 0:
        raise OSError(f"{codes.path}: short read of embedding row {row}: truncated store?")
    return out


RMS_NORM_MAX = 16384  # longest row the kernel normalizes: torch sums longer ones on several threads, in another order


def rms_norm_row(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``weight * F.rms_norm(x, ..., None, eps)`` for one bf16 CPU row ``x`` [1, H] and a bf16 ``weight`` [H], with its
    bits (``layer.rms_norm``), or None where the kernel does not take them."""
    n = x.shape[-1]
    if (
        x.dim() != 2
        or x.shape[0] != 1
        or x.dtype != torch.bfloat16
        or weight.dtype != torch.bfloat16
        or x.device.type != "cpu"
        or n > RMS_NORM_MAX
        or weight.shape != (n,)
        or not x.is_contiguous()
        or not weight.is_contiguous()
        or not available()[0]
    ):
        return None
    out = torch.empty_like(x)
    if _kernel.lib.fe_rms_norm_bf16(x.data_ptr(), n, weight.data_ptr(), eps, out.data_ptr()) != 0:
        return None
    return out


@dataclass
class RopeRows:
    """One decode token's rope for :func:`rope_`: bf16 cos and signed sin [1, d] (``RotaryEmbedding.cos_sin``)."""

    cos: torch.Tensor
    sin: torch.Tensor

    @staticmethod
    def of(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> RopeRows | None:
        """The native rope for a bf16 CPU row ``x`` with bf16 ``cos``/``sin`` [1, d], or None where it does not
        apply (another dtype or device, no kernel here)."""
        if x.device.type != "cpu" or x.dtype != torch.bfloat16 or cos.dtype != torch.bfloat16:
            return None
        if cos.shape[-1] > 1024 or cos.shape[-1] % 2 or not available()[0]:
            return None
        return RopeRows(cos.contiguous(), sin.contiguous())


def rope_(qk: torch.Tensor, rope: RopeRows, bias: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Rows ``qk`` [N, d] (contiguous bf16) rotated in place: ``qk @ decode_step.rope_matrix(cos, sin)``'s bits.
    ``bias``: (a fused projection's whole output row ``flat``, starting at ``qk``, and its bf16 bias): the bias added
    to all of ``flat`` first, as ``flat + bias`` rounds."""
    rows, d = qk.shape
    if not qk.is_contiguous() or d != rope.cos.shape[-1] or qk.dtype != torch.bfloat16:
        raise ValueError(f"rope: rows {tuple(qk.shape)} do not fit cos {tuple(rope.cos.shape)}")
    b, total = None, 0
    if bias is not None:
        flat, b_t = bias
        if flat.data_ptr() != qk.data_ptr() or not flat.is_contiguous() or b_t.shape != flat.shape:
            raise ValueError(f"rope: a bias {tuple(b_t.shape)} for an output {tuple(flat.shape)} not starting at q")
        if flat.dtype != torch.bfloat16 or b_t.dtype != torch.bfloat16 or not b_t.is_contiguous():
            raise ValueError("rope: the bias and its output must be contiguous bf16")
        b, total = b_t.data_ptr(), flat.numel()
    rope_at(qk.data_ptr(), rows, rope, b, total)
    return qk


def rope_at(qk: int, rows: int, rope: RopeRows, bias: int | None, total: int) -> None:
    """:func:`rope_` on addresses: ``rows`` bf16 rows of ``rope``'s width at ``qk`` rotated in place, a bf16 bias of
    ``total`` values at ``bias`` (or None) added to the ``total`` values from ``qk`` first. Unchecked: the caller
    holds the rows alive and has checked the width (``attention_row``)."""
    d = rope.cos.shape[-1]
    if _kernel.lib.fe_rope_bf16(qk, rows, d, rope.cos.data_ptr(), rope.sin.data_ptr(), bias, total) != 0:
        raise ValueError(f"rope: the kernel does not take rows of {d}")


def head_norm_at(qk: int, nq: int, nk: int, d: int, q_norm: torch.Tensor, k_norm: torch.Tensor, eps: float) -> None:
    """Qwen3's per-head norm in place on a decode row's projection at ``qk``: its first ``nq`` bf16 rows of ``d`` by
    ``q_norm`` [d], the next ``nk`` by ``k_norm`` (both contiguous bf16), each row with :func:`rms_norm_row`'s bits.
    Unchecked address (``attention_row`` makes it from a tensor it holds)."""
    if _kernel.lib.fe_head_norm_bf16(qk, nq, nk, d, q_norm.data_ptr(), k_norm.data_ptr(), eps) != 0:
        raise ValueError(f"head norm: the kernel does not take rows of {d}")


def kv_append(k: int, v: int, heads: int, row_bytes: int, k_to: int, k_stride: int, v_to: int, v_stride: int) -> None:
    """One position's keys and values (``heads`` contiguous rows of ``row_bytes`` at ``k`` and ``v``) copied to
    ``k_to`` and ``v_to``, head h ``h * k_stride`` / ``h * v_stride`` bytes on: a [heads, positions, d] cache's
    place for them. Unchecked addresses (``attention_row`` makes them from tensors it holds)."""
    _kernel.lib.fe_kv_append(k, v, heads, row_bytes, k_to, k_stride, v_to, v_stride)
