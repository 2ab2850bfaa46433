"""Streaming writer of sharded safetensors checkpoints (``model-0000i-of-0000N.safetensors`` + index).

The safetensors format is an 8-byte little-endian header length, a JSON header (dtype, shape and byte
range of every tensor; padded with spaces to a multiple of 8) and the raw little-endian tensor bytes.
All shapes are known up front, so each shard's header is written first and then each tensor's bytes
block by block: memory holds one block, whatever the checkpoint's size.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

import torch

from fate_edge.format.checkpoint import INDEX_FILE
from fate_edge.format.safetensors_header import DTYPE_BYTES

SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
DEFAULT_SHARD_BYTES = 2 * 1000**3  # ~2 GB shards


class Entry(Protocol):
    """What the writer needs of a tensor (e.g. a :class:`~fate_edge_lab.synthetic.layout.TensorSpec`)."""

    @property
    def name(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


E = TypeVar("E", bound=Entry)  # the caller's own entry type, handed back to its callbacks


def entry_dtype(e: Entry, dtype: str) -> str:
    """The entry's safetensors dtype: its own ``st_dtype`` (gpt-oss's uint8 MXFP4 blocks) or the checkpoint's."""
    return getattr(e, "st_dtype", None) or dtype


def nbytes(e: Entry, dtype: str) -> int:
    return math.prod(e.shape) * DTYPE_BYTES[entry_dtype(e, dtype)]


def plan_shards(entries: list[E], dtype: str, max_bytes: int = DEFAULT_SHARD_BYTES) -> list[list[E]]:
    """Consecutive tensors packed into shards of at most ``max_bytes`` (a bigger tensor gets a shard alone)."""
    shards: list[list[E]] = [[]]
    size = 0
    for e in entries:
        n = nbytes(e, dtype)
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += n
    return shards if shards[0] else []


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def header_bytes(entries: Sequence[Entry], dtype: str, metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length + padded JSON header of a safetensors file holding ``entries`` in this order."""
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for e in entries:
        end = offset + nbytes(e, dtype)
        header[e.name] = {"dtype": entry_dtype(e, dtype), "shape": list(e.shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # tensor data starts 8-byte aligned, as safetensors itself writes it
    return struct.pack("<Q", len(raw)) + raw


def _raw(block: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (bf16 has no numpy dtype: view as int16)."""
    block = block.contiguous()
    as_int = block.view(torch.int16) if block.dtype in (torch.bfloat16, torch.float16) else block
    return as_int.numpy().data.cast("B")


def write_checkpoint(
    out: Path,
    entries: Iterable[E],
    blocks: Callable[[E], Iterator[torch.Tensor]],
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    on_tensor: Callable[[E, int], None] | None = None,
) -> dict:
    """Write ``entries`` as sharded safetensors in ``out``, each tensor's values taken from ``blocks(entry)``
    (converted to ``dtype`` one block at a time; an entry with its own ``st_dtype`` U8 written as its uint8 blocks are),
    plus ``model.safetensors.index.json``; returns the index.
    ``on_tensor(entry, bytes)`` is called after each tensor (progress)."""
    st_dtype = SAFETENSORS_DTYPES[dtype]
    shards = plan_shards(list(entries), st_dtype, max_shard_bytes)
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        name = shard_name(i, len(shards))
        with (out / name).open("wb") as f:
            f.write(header_bytes(shard, st_dtype))
            for e in shard:
                want, wrote = nbytes(e, st_dtype), 0
                own = entry_dtype(e, st_dtype) != st_dtype
                for block in blocks(e):
                    if own and block.dtype != torch.uint8:
                        raise RuntimeError(f"{e.name}: the generator gave {block.dtype} blocks for a U8 tensor")
                    wrote += f.write(_raw(block if own else block.to(dtype)))
                if wrote != want:
                    raise RuntimeError(f"{e.name}: the generator gave {wrote} bytes for shape {e.shape}, not {want}")
                weight_map[e.name] = name
                total += want
                if on_tensor:
                    on_tensor(e, want)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return index
