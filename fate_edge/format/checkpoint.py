"""Lazy reading of Hugging Face safetensors checkpoints (single file or sharded).

Tensors are memory-mapped through ``safetensors.safe_open`` and read one at a time, so the runtime
can load the resident weights without touching the routed experts, and read a single expert's
matrices (a row of a fused ``[E, ...]`` tensor included) without reading its neighbours.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path

import torch
from safetensors import safe_open

from fate_edge.errors import CorruptCheckpointError, MissingTensorError, ModelFormatError
from fate_edge.format.direct_write import DirectFile
from fate_edge.format.safetensors_header import DTYPE_BYTES, MAX_HEADER_BYTES, check_header
from fate_edge.format.store_files import check_store_complete
from fate_edge.format.tensor_names import common_names, model_type_of
from fate_edge.small_files import read_json_object

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _check_safetensors_file(path: Path) -> tuple[int, dict]:
    """Detect truncation before safetensors does, so the error can say what happened and what to do.
    Returns where the tensor data starts and the header."""
    size = path.stat().st_size
    fix = "re-download or re-copy the file; it is shorter than its own header says"
    if size < 8:
        raise CorruptCheckpointError(f"{path}: {size} bytes is too short for a safetensors file; {fix}")
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if 8 + header_len > size:
            raise CorruptCheckpointError(f"{path}: header claims {header_len} bytes but the file has {size}; {fix}")
        if header_len > MAX_HEADER_BYTES:
            raise CorruptCheckpointError(f"{path}: a header of {header_len} bytes is past safetensors' limit; {fix}")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptCheckpointError(f"{path}: unreadable safetensors header ({exc}); {fix}") from exc
    check_header(header, path, size - 8 - header_len)
    return 8 + header_len, header


class CheckpointReader:
    """Name → tensor access over the safetensors files of one model directory.

    Tensor bytes are read with ``pread`` into memory the tensor owns, not through a memory map: a map
    keeps every page read in the process's RSS until the kernel needs it back, so streaming a 28 GB
    checkpoint would show a resident set as large as the memory cap allows. ``drop_cache``: also tell the
    kernel the pages read will not be needed again (convert reads each byte once)."""

    def __init__(self, model_dir: str | Path, drop_cache: bool = False):
        self.model_dir = Path(model_dir)
        self.drop_cache = drop_cache
        self._files: dict[str, tuple[int, int, dict]] = {}  # file -> (fd, data start, header)
        self._lock = threading.RLock()  # convert reads from several threads: each file opened once
        check_store_complete(self.model_dir)
        index_path = self.model_dir / INDEX_FILE
        if index_path.exists():
            weight_map = read_json_object(index_path).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelFormatError(f"{index_path}: not a valid safetensors index (no 'weight_map' object)")
        elif (self.model_dir / SINGLE_FILE).exists():
            weight_map = {}
        else:
            found = sorted(p.name for p in self.model_dir.glob("*.safetensors"))
            if not found:
                raise ModelFormatError(
                    f"{self.model_dir}: no {SINGLE_FILE} or {INDEX_FILE}; fate-edge reads safetensors checkpoints "
                    "(convert .bin/.pt weights with transformers' save_pretrained(safe_serialization=True))"
                )
            weight_map = {}
            for name in found:
                weight_map.update({k: name for k in self._open(self.model_dir / name).keys()})
        if not weight_map:
            weight_map = {k: SINGLE_FILE for k in self._open(self.model_dir / SINGLE_FILE).keys()}
        self.weight_map = _inside(weight_map, self.model_dir, index_path)
        # a family's own module names served as the common ones (format.tensor_names): common -> stored
        self.stored = common_names(model_type_of(self.model_dir), list(self.weight_map))
        if self.stored:
            renamed = set(self.stored.values())
            self.weight_map = {
                **{k: f for k, f in self.weight_map.items() if k not in renamed},
                **{k: self.weight_map[s] for k, s in self.stored.items()},
            }
        self._handles: dict[str, object] = {}

    def _open(self, path: Path):
        self._layout(path)
        try:
            return safe_open(str(path), framework="pt")
        except Exception as exc:  # safetensors raises its own error types
            raise CorruptCheckpointError(f"{path}: cannot open as safetensors ({exc})") from exc

    def _layout(self, path: Path) -> tuple[int, int, dict]:
        key = str(path)
        with self._lock:
            if key not in self._files:
                if not path.exists():
                    raise ModelFormatError(
                        f"{path}: shard listed in {INDEX_FILE} is missing; copy it next to the index"
                    )
                start, header = _check_safetensors_file(path)
                self._files[key] = (os.open(path, os.O_RDONLY), start, header)
            return self._files[key]

    def _read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor ``name``, or its rows ``rows[0]:rows[1]`` (clipped to 0..rows), read with pread."""
        self._require(name)
        fd, start, header = self._layout(self.model_dir / self.weight_map[name])
        info = header[self.stored.get(name, name)]
        dtype, shape = _TORCH_DTYPES[info["dtype"]], list(info["shape"])
        begin, end = info["data_offsets"]
        if rows is not None:
            row_bytes = (end - begin) // shape[0] if shape[0] else 0
            first, stop = (min(max(r, 0), shape[0]) for r in rows)
            stop = max(first, stop)
            begin, end = begin + first * row_bytes, begin + stop * row_bytes
            shape = [stop - first, *shape[1:]]
        buf = bytearray(end - begin)
        view, offset = memoryview(buf), start + begin
        while view:
            got = os.preadv(fd, [view], offset)
            if got == 0:
                raise CorruptCheckpointError(
                    f"{self.model_dir / self.weight_map[name]}: ended while reading "
                    f"'{name}'; re-download or re-copy the file"
                )
            view, offset = view[got:], offset + got
        if self.drop_cache and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, start + begin, end - begin, os.POSIX_FADV_DONTNEED)
        if not buf:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)

    def close(self) -> None:
        for fd, _, _ in self._files.values():
            os.close(fd)
        self._files.clear()

    def __del__(self) -> None:
        if getattr(self, "_files", None):
            self.close()

    def _handle(self, name: str):
        file = self.weight_map[name]
        with self._lock:
            if file not in self._handles:
                self._handles[file] = self._open(self.model_dir / file)
            return self._handles[file]

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def _require(self, name: str) -> None:
        if name not in self.weight_map:
            raise MissingTensorError(
                f"{self.model_dir}: tensor '{name}' not found in the checkpoint; the files are incomplete or were "
                "saved for another architecture (check config.json's model_type and re-export the model)"
            )

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = self._read(name)
        return t.to(dtype) if dtype is not None else t

    def get_row(self, name: str, index: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``tensor[index]`` of a fused tensor, reading only that slice from disk."""
        if not 0 <= index < self.shape(name)[0]:
            raise IndexError(f"row {index} of '{name}' (shape {self.shape(name)}) is out of range")
        t = self._read(name, (index, index + 1))[0]
        return t.to(dtype) if dtype is not None else t

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """``tensor[start:stop]``, reading only those rows from disk."""
        return self._read(name, (start, stop))

    def dtype_name(self, name: str) -> str:
        """The tensor's safetensors dtype ("BF16", "F32", ...), without reading it."""
        self._require(name)
        return self._handle(name).get_slice(self.stored.get(name, name)).get_dtype()

    def shape(self, name: str) -> list[int]:
        self._require(name)
        return list(self._handle(name).get_slice(self.stored.get(name, name)).get_shape())

    def nbytes(self, name: str) -> int:
        self._require(name)
        sl = self._handle(name).get_slice(self.stored.get(name, name))
        n = 1
        for d in sl.get_shape():
            n *= d
        return n * DTYPE_BYTES.get(sl.get_dtype(), 4)


def _inside(weight_map: dict[str, str], model_dir: Path, index_path: Path) -> dict[str, str]:
    """``weight_map`` when every shard it names is a plain file name in ``model_dir`` (nothing outside is read)."""
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file or file != Path(file).name or file in (".", ".."):
            raise ModelFormatError(
                f"{index_path}: tensor '{name}' is in shard {file!r}, not a file name inside the model directory; "
                "the index is damaged (shards sit beside it)"
            )
    return weight_map


_TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


# safetensors' own order for the tensors of a file: by dtype, widest enum value first, then by name.
_DTYPE_ORDER = [
    "BOOL",
    "F4",
    "F6_E2M3",
    "F6_E3M2",
    "U8",
    "I8",
    "F8_E5M2",
    "F8_E4M3",
    "F8_E8M0",
    "I16",
    "U16",
    "F16",
    "BF16",
    "I32",
    "U32",
    "F32",
    "C64",
    "F64",
    "I64",
    "U64",
]
STREAM_CHUNK_BYTES = 64 << 20  # a larger tensor is copied this many bytes of rows at a time


def save_streaming(
    reader: CheckpointReader, names: list[str], path: str | Path, metadata: dict[str, str] | None = None, on_tensor=None
) -> int:
    """Write tensors ``names`` of ``reader`` to the safetensors file ``path`` one block of rows at a time, so
    memory holds at most STREAM_CHUNK_BYTES of them (``safe_open`` + ``save_file`` would hold them all).
    The file is byte for byte what ``safetensors.torch.save_file`` writes. ``on_tensor(name, nbytes)`` is
    called after each tensor. Returns the bytes of tensor data written."""
    info = {n: (reader.dtype_name(n), reader.shape(n), reader.nbytes(n)) for n in names}
    order = sorted(names, key=lambda n: (-_DTYPE_ORDER.index(info[n][0]), n))
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for n in order:
        dtype, shape, nbytes = info[n]
        header[n] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with DirectFile(path) as f:  # O_DIRECT where it can: each byte is written once, never read back here
        f.write(struct.pack("<Q", len(raw)) + raw)
        for n in order:
            dtype, shape, nbytes = info[n]
            row_bytes = nbytes // shape[0] if shape and shape[0] else nbytes
            step = max(1, STREAM_CHUNK_BYTES // max(row_bytes, 1))
            if len(shape) < 2 or shape[0] <= step:
                f.write(_raw_bytes(reader.get(n)))
            else:
                for r0 in range(0, shape[0], step):
                    f.write(_raw_bytes(reader.get_rows(n, r0, r0 + step)))
            if on_tensor is not None:
                on_tensor(n, nbytes)
    return offset


def _raw_bytes(t: torch.Tensor):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()
