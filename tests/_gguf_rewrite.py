"""Write a GGUF again from a parsed header with its metadata or tensor table changed, keeping the tensor bytes:
how the validation tests and the fuzzer make damaged files that are otherwise real."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fate_edge.format.gguf_header import Header, HeaderTensor, read_header

_STRING, _ARRAY, _BOOL, _U64, _I64, _F64 = 8, 9, 7, 10, 11, 12


@dataclass
class Parsed:
    header: Header
    data: bytes  # the data section, from the header's data_start to the end of the file


def parse(path: Path) -> Parsed:
    header = read_header(path)
    return Parsed(header, path.read_bytes()[header.data_start :])


def _type_of(value: Any) -> int:
    if isinstance(value, bool):
        return _BOOL
    if isinstance(value, str):
        return _STRING
    if isinstance(value, int):
        return _I64 if -(1 << 63) <= value < 1 << 63 else _U64
    if isinstance(value, float):
        return _F64
    if isinstance(value, list):
        return _ARRAY
    raise TypeError(f"no GGUF type for {type(value).__name__}")


def _string(s: str) -> bytes:
    raw = s.encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(raw)) + raw


def _value(value: Any, vtype: int) -> bytes:
    if vtype == _STRING:
        return _string(value)
    if vtype == _BOOL:
        return struct.pack("<?", value)
    if vtype == _I64:
        return struct.pack("<q", value)
    if vtype == _U64:
        return struct.pack("<Q", value % (1 << 64))
    if vtype == _F64:
        return struct.pack("<d", value)
    etype = _type_of(value[0]) if value else _I64
    return struct.pack("<IQ", etype, len(value)) + b"".join(_value(v, etype) for v in value)


def write(
    out: Path,
    fields: dict[str, Any],
    tensors: list[HeaderTensor],
    data: bytes,
    alignment: int = 32,
) -> Path:
    """A GGUF v3 file at ``out`` with these fields, this tensor table and this data section."""
    parts = [b"GGUF", struct.pack("<IQQ", 3, len(tensors), len(fields))]
    for key, value in fields.items():
        vtype = _type_of(value)
        parts += [_string(key), struct.pack("<I", vtype), _value(value, vtype)]
    for t in tensors:
        parts += [_string(t.name), struct.pack("<I", len(t.dims)), *(struct.pack("<Q", d) for d in t.dims)]
        parts.append(struct.pack("<IQ", t.qtype, t.offset))
    head = b"".join(parts)
    pad = (-len(head)) % alignment
    out.write_bytes(head + b"\0" * pad + data)
    return out


def rewrite(src: Parsed, out: Path, fields: dict[str, Any] | None = None, tensors=None) -> Path:
    """``src`` with its fields and tensor table replaced where given."""
    f = src.header.fields if fields is None else fields
    align = f.get("general.alignment", 32)
    align = align if isinstance(align, int) and not isinstance(align, bool) and 1 <= align <= 1 << 20 else 32
    return write(out, f, src.header.tensors if tensors is None else tensors, src.data, align)
