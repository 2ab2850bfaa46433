"""A GGUF file's header parsed in one pass: the metadata as Python values and the tensor table.

The ``gguf`` package's reader builds a numpy view per value, which is slow on a 150k-token vocabulary's
metadata (two arrays of 150k strings; docs/measured-choices.md); this reads the same layout (GGUF v2 and v3,
little-endian) with ``struct`` over a memory map of the header in a fraction of that. Tensor bytes are not touched here.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fate_edge.errors import ModelFormatError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF value types -> (struct format, numpy dtype) for the fixed-size ones; 8 is a string, 9 an array
_SCALARS = {
    0: ("<B", np.uint8),
    1: ("<b", np.int8),
    2: ("<H", np.uint16),
    3: ("<h", np.int16),
    4: ("<I", np.uint32),
    5: ("<i", np.int32),
    6: ("<f", np.float32),
    7: ("<?", np.bool_),
    10: ("<Q", np.uint64),
    11: ("<q", np.int64),
    12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class HeaderTensor:
    name: str
    dims: tuple[int, ...]  # ggml's order (fastest-varying first)
    qtype: int  # ggml's type number
    offset: int  # from the start of the data section


@dataclass(frozen=True)
class Header:
    version: int
    fields: dict[str, Any]
    tensors: list[HeaderTensor]
    data_start: int  # absolute offset of the data section


class _Cursor:
    def __init__(self, buf: mmap.mmap):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise struct.error("string runs past the end of the file")
        s = self.buf[self.pos : end].decode("utf-8", errors="replace")
        self.pos = end
        return s

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype == _STRING:
                return [self.string() for _ in range(count)]
            if etype in _SCALARS:
                dtype = np.dtype(_SCALARS[etype][1]).newbyteorder("<")
                end = self.pos + count * dtype.itemsize
                if end > len(self.buf):
                    raise struct.error("array runs past the end of the file")
                out = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).tolist()
                self.pos = end
                return out
            return [self.value(etype) for _ in range(count)]  # arrays of arrays
        if vtype not in _SCALARS:
            raise ModelFormatError(f"metadata value type {vtype} is not a GGUF type")
        return self.scalar(_SCALARS[vtype][0])


def read_header(path: str | Path) -> Header:
    """The header of the GGUF at ``path``. A cut or malformed header raises ``struct.error`` (the caller names the
    file); a file that is not GGUF, or of an unsupported version, a :class:`ModelFormatError`."""
    path = Path(path)
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != MAGIC:
            raise ModelFormatError(f"{path}: not a GGUF file (no GGUF magic)")
        c = _Cursor(buf)
        c.pos = 4
        version = c.scalar("<I")
        if version not in (2, 3):
            raise ModelFormatError(f"{path}: GGUF version {version}; fate-edge reads versions 2 and 3 (re-convert it)")
        n_tensors, n_kv = c.scalar("<Q"), c.scalar("<Q")
        fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = c.string()
            fields[key] = c.value(c.scalar("<I"))
        tensors = []
        for _ in range(n_tensors):
            name = c.string()
            n_dims = c.scalar("<I")
            dims = tuple(c.scalar("<Q") for _ in range(n_dims))
            tensors.append(HeaderTensor(name, dims, c.scalar("<I"), c.scalar("<Q")))
        align = fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if isinstance(align, bool) or not isinstance(align, int) or not 1 <= align <= 1 << 20 or align & (align - 1):
            raise ModelFormatError(f"{path}: general.alignment is {align!r}, not a power of two; the header is damaged")
        data_start = -(-c.pos // align) * align
    return Header(version, fields, tensors, data_start)
