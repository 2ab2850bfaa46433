"""Lazy reading of Hugging Face safetensors checkpoints (single file or sharded).

Tensors are memory-mapped through ``safetensors.safe_open`` and read one at a time, so the runtime
can load the resident weights without touching the routed experts, and read a single expert's
matrices (a row of a fused ``[E, ...]`` tensor included) without reading its neighbours.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from .errors import CorruptCheckpointError, MissingTensorError, ModelFormatError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _check_safetensors_file(path: Path) -> None:
    """Detect truncation before safetensors does, so the error can say what happened and what to do."""
    size = path.stat().st_size
    fix = "re-download or re-copy the file; it is shorter than its own header says"
    if size < 8:
        raise CorruptCheckpointError(f"{path}: {size} bytes is too short for a safetensors file; {fix}")
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if 8 + header_len > size:
            raise CorruptCheckpointError(f"{path}: header claims {header_len} bytes but the file has {size}; {fix}")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptCheckpointError(f"{path}: unreadable safetensors header ({exc}); {fix}") from exc
    data_end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + data_end > size:
        missing = 8 + header_len + data_end - size
        raise CorruptCheckpointError(f"{path}: truncated, {missing} bytes of tensor data are missing; {fix}")


class CheckpointReader:
    """Name → tensor access over the safetensors files of one model directory."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        from .store import check_store_complete

        check_store_complete(self.model_dir)
        index_path = self.model_dir / INDEX_FILE
        if index_path.exists():
            try:
                weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise ModelFormatError(f"{index_path}: not a valid safetensors index ({exc})") from exc
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
        self.weight_map = weight_map
        self._handles: dict[str, object] = {}

    def _open(self, path: Path):
        if not path.exists():
            raise ModelFormatError(f"{path}: shard listed in {INDEX_FILE} is missing; copy it next to the index")
        _check_safetensors_file(path)
        try:
            return safe_open(str(path), framework="pt")
        except Exception as exc:  # safetensors raises its own error types
            raise CorruptCheckpointError(f"{path}: cannot open as safetensors ({exc})") from exc

    def _handle(self, name: str):
        file = self.weight_map[name]
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
        self._require(name)
        t = self._handle(name).get_tensor(name)
        return t.to(dtype) if dtype is not None else t

    def get_row(self, name: str, index: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``tensor[index]`` of a fused tensor, reading only that slice from disk."""
        self._require(name)
        t = self._handle(name).get_slice(name)[index]
        return t.to(dtype) if dtype is not None else t

    def shape(self, name: str) -> list[int]:
        self._require(name)
        return list(self._handle(name).get_slice(name).get_shape())

    def nbytes(self, name: str) -> int:
        self._require(name)
        sl = self._handle(name).get_slice(name)
        n = 1
        for d in sl.get_shape():
            n *= d
        return n * _DTYPE_SIZES.get(sl.get_dtype(), 4)


_DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                "F8_E4M3": 1, "F8_E5M2": 1}
