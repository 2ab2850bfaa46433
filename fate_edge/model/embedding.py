"""The token embedding table as the model holds it, and the gather of rows from it.

At a real vocabulary the table is the largest resident tensor (Qwen1.5-MoE: 151936 x 2048, 622 MB in bf16), and a
token reads one row of it. So it may be held quantized and rows dequantized as they are gathered, as llama.cpp does:
``embedding_bits`` 8 (per-row int8, ``w ≈ codes * scale``, the layout of ``quant.int8``) or 4 (group-wise int4,
``w ≈ codes * scale + zero``, the RTN of ``quant.rtn``, two codes a byte). Quantized tables live in the resident
weights under their own names, so a store can carry them pre-quantized (``convert --resident-bits``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from fate_edge.model import row_ops
from fate_edge.quant import QuantSpec, dequantize, pack, quantize, unpack
from fate_edge.quant.int8 import Int8Linear, quantize_int8
from fate_edge.quant.rtn import Quantized

NAME = "model.embed_tokens"
EMBEDDING_BITS = (8, 4)
_BLOCK_ROWS = 4096  # rows quantized at a time at load: no full-precision copy of the table


def int4_group(hidden: int) -> int:
    """The group of an int4 table: the largest of 128, 64, 32 dividing the width."""
    group = next((g for g in (128, 64, 32) if hidden % g == 0), None)
    if group is None:
        raise ValueError(f"embedding width {hidden} is not a multiple of 32; use --embedding-bits 8")
    return group


def quantized_names(bits: int) -> list[str]:
    """The resident-weight names of a table quantized to ``bits``."""
    parts = {8: ["int8", "int8_scale"], 4: ["int4", "int4_scale", "int4_zero", "int4_group"]}[bits]
    return [f"{NAME}.{p}" for p in parts]


def quantized_bytes(shape: tuple[int, int], bits: int) -> int:
    """Bytes of a [V, H] table held at ``bits`` (what :func:`quantize_table` returns)."""
    v, h = shape
    if bits == 8:
        return v * h + 2 * v
    return v * h // 2 + 2 * 2 * v * (h // int4_group(h)) + 8


def embedding_bytes(shape: Sequence[int], dtype: torch.dtype, bits: int | None = None) -> int:
    """Bytes an embedding table of ``shape`` [V, H] takes once loaded at ``dtype``, or quantized to ``bits``."""
    v, h = shape[0], shape[1]
    if bits is not None:
        return quantized_bytes((v, h), bits)
    return v * h * torch.empty(0, dtype=dtype).element_size()


def quantize_table(rows, shape: Sequence[int], bits: int) -> dict[str, torch.Tensor]:
    """Quantize a [V, H] table read ``_BLOCK_ROWS`` rows at a time (``rows(start, stop)`` -> float tensor)."""
    if bits not in EMBEDDING_BITS:
        raise ValueError(f"embedding_bits must be 8 or 4 (or None for the compute dtype), not {bits}")
    v, h = shape
    names = quantized_names(bits)
    if bits == 8:
        codes, scale = torch.empty(v, h, dtype=torch.int8), torch.empty(v, dtype=torch.bfloat16)
        for r in range(0, v, _BLOCK_ROWS):
            codes[r : r + _BLOCK_ROWS], scale[r : r + _BLOCK_ROWS] = quantize_int8(rows(r, min(v, r + _BLOCK_ROWS)))
        return dict(zip(names, (codes, scale)))
    spec = QuantSpec(4, int4_group(h))
    packed = torch.empty(v, h // 2, dtype=torch.uint8)
    scale = torch.empty(v, h // spec.group_size, dtype=torch.float16)
    zero = torch.empty_like(scale)
    for r in range(0, v, _BLOCK_ROWS):
        stop = min(v, r + _BLOCK_ROWS)
        q = quantize(rows(r, stop), spec)
        packed[r:stop], scale[r:stop], zero[r:stop] = pack(q.codes, 4), q.scale, q.zero
    return dict(zip(names, (packed, scale, zero, torch.tensor(spec.group_size))))


class RowSource(Protocol):
    """Rows of a stored table read on demand (``fate_edge.format.file_rows.FileRows``)."""

    def gather(self, ids: torch.Tensor) -> torch.Tensor: ...


@dataclass
class QuantizedEmbedding:
    """An embedding table held in 8 or 4 bits; calling it gathers rows and dequantizes them to ``dtype``."""

    bits: int
    codes: torch.Tensor  # int8 [V, H] (8) or packed uint8 [V, H/2] (4)
    scale: torch.Tensor  # bf16 [V] (8) or fp16 [V, H/g] (4)
    zero: torch.Tensor | None  # fp16 [V, H/g] (4)
    dtype: torch.dtype
    # codes, scale, zero read by row from the store's file where the table is memory-mapped from one: a gather
    # through the mapping would fault in the pages around every row (readahead), most of the table in a long prompt
    rows: tuple[RowSource, ...] | None = field(default=None, repr=False)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.codes.shape[0], self.codes.shape[1] * (2 if self.bits == 4 else 1)))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero) if t is not None)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` [N] -> rows [N, H] in ``dtype``."""
        if self.rows is not None and ids.device.type == "cpu" and not torch.compiler.is_compiling():
            codes_rows, scale_rows = self.rows[0], self.rows[-1]
            if self.bits == 8 and ids.numel() == 1 and row_ops.is_file_table(codes_rows):
                assert row_ops.is_file_table(scale_rows)  # both parts come from the same store
                # a decode token's row: read and dequantized in one native call, the same bits
                row = row_ops.embed_int8_row(codes_rows, scale_rows, int(ids.reshape(-1)[0]), self.dtype)
                if row is not None:
                    return row
            parts = [r.gather(ids) for r in self.rows]
        else:
            parts = [t.index_select(0, ids) for t in (self.codes, self.scale, self.zero) if t is not None]
        codes, scale = parts[0], parts[1]
        if self.bits == 8:  # as Int8Linear dequantizes
            return (codes.float() * scale.float()[:, None]).to(self.dtype)
        assert self.zero is not None  # int4 tables have one
        zero = parts[2]
        spec = QuantSpec(4, self.shape[1] // scale.shape[1])
        return dequantize(Quantized(unpack(codes, 4), scale, zero), spec).to(self.dtype)

    def as_linear(self):
        """The table as an output projection (tied embeddings): int8 through torch's int8 kernel; int4 through a
        quantized linear built from the same codes (in the kernel's own layout, a second copy of the codes)."""
        if self.bits == 8:
            return Int8Linear(self.codes, self.scale)
        from fate_edge.quant.linear import QuantizedLinear, default_kernel

        spec = QuantSpec(4, self.shape[1] // self.scale.shape[1])
        assert self.zero is not None  # int4 tables have one
        if default_kernel(tuple(self.shape), spec, self.device) == "native-int4":
            # the native kernel reads the table's own layout (two codes a byte, low nibble first): no copy. Unpacking
            # and packing again cost a large vocabulary's first forward seconds and gigabytes (measured-choices.md)
            return QuantizedLinear.from_native(self.codes, self.scale, self.zero, spec)
        return QuantizedLinear.from_quantized(
            Quantized(unpack(self.codes, 4), self.scale, self.zero), spec, self.device
        )


def embedding_table(
    w: dict[str, torch.Tensor], dtype: torch.dtype, rows: dict[str, RowSource] | None = None
) -> torch.Tensor | QuantizedEmbedding:
    """The table in the resident weights ``w``: the float tensor, or its quantized form where the loader (or the
    store) left one; ``rows``: its parts by name where they can be read by row from the store's file."""
    rows = rows or {}
    for bits in EMBEDDING_BITS:
        names = quantized_names(bits)[: 2 if bits == 8 else 3]
        if names[0] in w:
            from_file = tuple(rows[n] for n in names) if all(n in rows for n in names) else None
            zero = w[names[2]] if bits == 4 else None
            return QuantizedEmbedding(bits, w[names[0]], w[names[1]], zero, dtype, from_file)
    return w[f"{NAME}.weight"]


def lookup(table: torch.Tensor | QuantizedEmbedding, ids: torch.Tensor) -> torch.Tensor:
    """``F.embedding(ids, table)`` for a float table; the quantized table's gather otherwise."""
    if isinstance(table, torch.Tensor):
        return F.embedding(ids, table)
    return table(ids)
