"""A GGUF file opened for conversion: its metadata as Python values, its tensors' types, shapes and places, and
their bytes read with ``pread`` (not through a memory map, so converting a 20 GB file keeps no 20 GB in RSS).

The header is parsed by :mod:`gguf_header`; a truncated download is named with the first tensor it cuts, and any
tensor type is dequantized as the ``gguf`` package (llama.cpp's own Python reader and dequantizers) does: the common
block types by :mod:`gguf_dequant` in torch, float for float the same, the others by the package itself.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fate_edge.errors import CorruptCheckpointError, ModelFormatError
from fate_edge.format.gguf_dequant import TORCH_TYPES, dequantize_blocks
from fate_edge.format.gguf_header import DEFAULT_ALIGNMENT, read_header

MAGIC = b"GGUF"
_FIX = "re-download or re-copy the file"


def is_gguf(path: str | Path) -> bool:
    """A regular file that starts with the GGUF magic (the suffix alone is not trusted)."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == MAGIC


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # PyTorch's order (ggml's reversed): a stacked expert tensor is [E, N, K]
    offset: int  # absolute file offset of the first byte
    nbytes: int

    @property
    def type_name(self) -> str:
        return self.qtype.name

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (the last dimension, in blocks)."""
        rows = 1
        for d in self.shape[:-1]:
            rows *= d
        return self.nbytes // max(rows, 1)


class GGUFFile:
    """Name → tensor access over one GGUF file. ``drop_cache``: tell the kernel each range read will not be read
    again (convert reads every byte once)."""

    def __init__(self, path: str | Path, drop_cache: bool = False):
        self.path = Path(path)
        self.model_dir = self.path  # errors name the file
        self.drop_cache = drop_cache
        self.last_key = ""
        from gguf import GGML_QUANT_SIZES

        if not self.path.is_file():
            raise ModelFormatError(f"{self.path}: not found")
        size = self.path.stat().st_size
        try:
            header = read_header(self.path)
        except ModelFormatError:
            raise
        except Exception as exc:  # struct.error, IndexError, ... on a cut header
            raise CorruptCheckpointError(
                f"{self.path}: unreadable GGUF header ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else 'file ends early'}); "
                f"{_FIX}"
            ) from exc
        self.fields: dict[str, Any] = header.fields
        self.tensors: dict[str, TensorInfo] = {}
        align = header.fields.get("general.alignment", DEFAULT_ALIGNMENT)  # read_header checked it
        for t in header.tensors:
            qtype = _quant_type(self.path, t.name, t.qtype)
            block, type_size = GGML_QUANT_SIZES[qtype]
            n = _elements(self.path, t.name, t.dims, block)
            if t.offset % align:
                raise CorruptCheckpointError(
                    f"{self.path}: tensor '{t.name}' starts at data offset {t.offset}, not a multiple of the "
                    f"file's alignment {align}; the tensor table is damaged, {_FIX}"
                )
            if t.name in self.tensors:
                raise CorruptCheckpointError(f"{self.path}: tensor '{t.name}' is listed twice; {_FIX}")
            shape = tuple(reversed(t.dims))
            self.tensors[t.name] = TensorInfo(
                t.name, qtype, shape, header.data_start + t.offset, n // block * type_size
            )
        cut = [t for t in self.tensors.values() if t.offset + t.nbytes > size]
        if cut:
            first = min(cut, key=lambda t: t.offset)
            missing = max(t.offset + t.nbytes for t in cut) - size
            raise CorruptCheckpointError(
                f"{self.path}: truncated, tensor '{first.name}' and {len(cut) - 1} after it "
                f"are cut off ({missing} bytes missing); {_FIX}"
            )
        self._fd: int | None = os.open(self.path, os.O_RDONLY)

    # ----------------------------------------------------------------- metadata
    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    def get(self, key: str, default: Any = None) -> Any:
        self.last_key = key  # names the key in an error about a value of the wrong kind (metadata_read)
        return self.fields.get(key, default)

    def require(self, key: str) -> Any:
        self.last_key = key
        if key not in self.fields:
            raise ModelFormatError(
                f"{self.path}: metadata key '{key}' is missing; the GGUF is incomplete or was "
                "written for another architecture (re-convert it with llama.cpp)"
            )
        return self.fields[key]

    @contextmanager
    def metadata_read(self, what: str = "") -> Iterator[None]:
        """Inside, a metadata value of the wrong kind (a string where a count belongs, ...) surfaces as one
        ModelFormatError naming the key read last (through :meth:`get` or :meth:`arch_key`) and ``what`` it was
        read for."""
        try:
            yield
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError, OverflowError) as exc:
            value = self.fields.get(self.last_key, "absent")
            raise ModelFormatError(
                f"{self.path}: metadata '{self.last_key}' is {str(value)[:40]!s}, a value of the wrong kind"
                f"{f' for {what}' if what else ''} ({type(exc).__name__}: {exc}); the GGUF is damaged (re-convert it "
                "with llama.cpp)"
            ) from None

    def arch_key(self, suffix: str, default: Any = ...) -> Any:
        """``{architecture}.{suffix}``; required unless ``default`` is given."""
        key = f"{self.architecture}.{suffix}"
        self.last_key = key
        return self.require(key) if default is ... else self.fields.get(key, default)

    # ------------------------------------------------------------------ tensors
    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise ModelFormatError(
                f"{self.path}: tensor '{name}' not found; the GGUF is incomplete or does not match "
                "its metadata (re-convert it with llama.cpp)"
            )
        return self.tensors[name]

    def read_bytes(self, name: str, first_row: int = 0, rows: int | None = None) -> np.ndarray:
        """The raw bytes of ``name`` (``rows`` rows of its first dimension from ``first_row``; all by default) as a
        uint8 array of shape [rows, bytes per row]."""
        t = self.info(name)
        if self._fd is None:
            raise ValueError(f"{self.path}: read after close()")
        row_bytes = t.nbytes // t.shape[0] if len(t.shape) > 1 else t.nbytes
        rows = (t.shape[0] if len(t.shape) > 1 else 1) - first_row if rows is None else rows
        begin, length = t.offset + first_row * row_bytes, rows * row_bytes
        buf = bytearray(length)
        view, offset = memoryview(buf), begin
        while view:
            got = os.preadv(self._fd, [view], offset)
            if got == 0:
                raise CorruptCheckpointError(f"{self.path}: ended while reading tensor '{name}'; {_FIX}")
            view, offset = view[got:], offset + got
        if self.drop_cache and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, begin, length, os.POSIX_FADV_DONTNEED)
        return np.frombuffer(buf, dtype=np.uint8).reshape(rows, row_bytes)

    def dequantize(
        self, name: str, first_row: int = 0, rows: int | None = None, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Tensor ``name`` (or rows of its first dimension) in float32, rounded to ``dtype`` if another: the common
        block types in torch (:mod:`gguf_dequant`), any other by the ``gguf`` package's dequantizers."""
        return self.dequantize_bytes(name, self.read_bytes(name, first_row, rows), dtype)

    def dequantize_bytes(self, name: str, raw: np.ndarray, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows of tensor ``name`` from their raw bytes (uint8 [rows, bytes per row], as :meth:`read_bytes` gives
        them): what :meth:`dequantize` returns for those rows."""
        t = self.info(name)
        shape = (raw.shape[0], *t.shape[1:]) if len(t.shape) > 1 else t.shape
        if t.type_name in TORCH_TYPES:  # bit-equal to the package's numpy dequantizers, several times faster
            return dequantize_blocks(t.type_name, torch.from_numpy(raw), dtype).reshape(shape)
        from gguf import GGMLQuantizationType, quants

        try:
            if t.qtype == GGMLQuantizationType.F32:
                out = raw.view(np.float32)
            elif t.qtype == GGMLQuantizationType.F16:
                out = raw.view(np.float16).astype(np.float32)
            elif t.qtype == GGMLQuantizationType.BF16:
                out = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            else:
                out = quants.dequantize(raw, t.qtype)
        except NotImplementedError:
            raise ModelFormatError(
                f"{self.path}: tensor '{name}' has quant type {t.type_name}, which the gguf "
                "package cannot dequantize; re-quantize the model to q4_0, q4_K, q8_0 or another "
                "type llama.cpp's gguf-py reads"
            ) from None
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(shape).to(dtype)

    def close(self) -> None:
        fd = getattr(self, "_fd", None)  # absent when __init__ raised before opening
        if fd is not None:
            os.close(fd)
            self._fd = None

    def __del__(self) -> None:
        self.close()


MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ELEMENTS = 1 << 40  # a tensor of 2^40 values is 500 GB at 4 bits: beyond any model, a damaged table


def _elements(path: Path, name: str, dims: tuple[int, ...], block: int) -> int:
    """The values in tensor ``name`` of ggml dims ``dims``, or one error naming the tensor and what is wrong."""
    if not 1 <= len(dims) <= MAX_DIMS or any(d < 1 for d in dims):
        raise CorruptCheckpointError(
            f"{path}: tensor '{name}' has dimensions {list(dims)}; each of 1..{MAX_DIMS} dimensions must be at least "
            f"1, the tensor table is damaged; {_FIX}"
        )
    n = 1
    for d in dims:
        n *= d
    if n > MAX_ELEMENTS or dims[0] % block:
        raise CorruptCheckpointError(
            f"{path}: tensor '{name}' has dimensions {list(dims)}: "
            + ("too many values" if n > MAX_ELEMENTS else f"rows are not whole blocks of {block}")
            + f"; the tensor table is damaged, {_FIX}"
        )
    return n


def _quant_type(path: Path, name: str, number: int):
    """The ggml type ``number`` of tensor ``name``, or a one-line error naming both."""
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(number)
    except ValueError:
        raise ModelFormatError(
            f"{path}: tensor '{name}' has quant type {number}, which this gguf package does not know; re-quantize "
            "the model to q4_0, q4_K, q8_0 or another common type, or upgrade the gguf package"
        ) from None
