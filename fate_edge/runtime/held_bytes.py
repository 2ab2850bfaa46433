"""What an object really holds in memory, as opposed to what its tensors' shapes say (``nbytes``).

A tensor that is a view keeps its whole base alive: an expert decoded from a blob whose scales stay a view of it
holds the blob's bytes too, and the cache must charge them (an expert in torch's CPU int4 layout re-packed on
arrival kept its uploaded blob through its scales: ~8.9 MB held for 4.6 MB charged at Qwen1.5-MoE's shapes).
Pinned host memory is rounded up by torch's caching host allocator, so a staging buffer holds more than asked.
"""

from __future__ import annotations

from typing import Any

import torch

_MAX_DEPTH = 6  # an expert → its linears → their quantized parts → tensors: a few levels


def held_bytes(obj: Any) -> int:
    """Bytes of every distinct storage the tensors reachable from ``obj`` (attributes, dataclass fields, lists,
    tuples, dicts) keep alive, each counted once: a view counts its whole base."""
    seen: dict[tuple[str, int], int] = {}
    _walk(obj, seen, set(), 0)
    return sum(seen.values())


def _walk(obj: Any, seen: dict[tuple[str, int], int], visited: set[int], depth: int) -> None:
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        seen[(str(obj.device), storage.data_ptr())] = storage.nbytes()
        return
    if depth > _MAX_DEPTH or id(obj) in visited or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    visited.add(id(obj))
    if isinstance(obj, (list, tuple)):
        items: Any = obj
    elif isinstance(obj, dict):
        items = obj.values()
    else:
        items = list(getattr(obj, "__dict__", {}).values())
    for item in items:
        _walk(item, seen, visited, depth + 1)


def pinned_held_bytes(nbytes: int) -> int:
    """Bytes torch's pinned host allocator holds for a request of ``nbytes``: the next power of two (its
    CachingHostAllocator rounds every block so; a 4.6 MB staging buffer holds 8 MiB)."""
    return 1 << max(0, nbytes - 1).bit_length() if nbytes > 0 else 0


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied into storage of its own where it is a view of a larger one (so it does not keep the rest)."""
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t


def entry_bytes(store: Any, layer: int, bits: int, dtype: torch.dtype, device: str) -> int:
    """Bytes one cached expert of ``store`` at ``bits`` holds on ``device``: decoded where it will run (a CUDA
    expert's kernel layout is not a CPU decode's), charged what it holds (:func:`held_bytes`)."""
    from fate_edge.format.store import decode_expert

    ref = store.ref(layer, 0, bits)
    with open(ref.path, "rb") as f:
        f.seek(ref.offset)
        blob = f.read(ref.length)
    expert = decode_expert(memoryview(bytearray(blob)), store.precisions[bits], dtype, device)
    return max(expert.nbytes, held_bytes(expert))
