"""A safetensors header checked before any tensor is read: an object of entries, each with a known dtype, a shape
of non-negative sizes, and data offsets that fit the file and hold exactly that many bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fate_edge.errors import CorruptCheckpointError

DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
_FIX = "re-download or re-copy the file"


def check_header(header: Any, path: Path, data_bytes: int) -> dict[str, Any]:
    """``header`` when every entry is sound for a data section of ``data_bytes``; else one error naming the entry."""
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path}: the safetensors header is a JSON {type(header).__name__}, not an object")
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor '{name}'"
        if not isinstance(entry, dict):
            raise CorruptCheckpointError(f"{where}: its header entry is not an object; {_FIX}")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
            raise CorruptCheckpointError(f"{where}: dtype {dtype!r} is not a safetensors dtype fate-edge reads")
        if not isinstance(shape, list) or len(shape) > 8 or not all(_count(d) for d in shape):
            raise CorruptCheckpointError(f"{where}: shape {shape!r} is not a list of sizes; {_FIX}")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_count(o) for o in offsets):
            raise CorruptCheckpointError(f"{where}: data_offsets {offsets!r} is not [begin, end]; {_FIX}")
        begin, end = offsets
        if begin > end or end > data_bytes:
            raise CorruptCheckpointError(
                f"{where}: data_offsets [{begin}, {end}] run past the end of the file's {data_bytes} data bytes "
                f"or backwards; the file is truncated or damaged, {_FIX}"
            )
        n = DTYPE_BYTES[dtype]
        for d in shape:
            n *= d
        if end - begin != n:
            raise CorruptCheckpointError(
                f"{where}: shape {shape} of {dtype} is {n} bytes but its data_offsets hold {end - begin}; {_FIX}"
            )
    return header


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
