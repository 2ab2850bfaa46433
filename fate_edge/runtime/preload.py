"""Fate's expert cache filled at load, so the first tokens do not start cold (the authors' ARC caches start full).

Which experts: every layer whose partition holds the whole layer (the resident first layer, the shallow layers
of shallow-favoring) gets all of them; a partially cached layer gets its most used experts by the calibration
counts (``fate-edge calibrate``'s popularity.json) when the model has them, else its lowest-numbered ones, as
Fate does. The reads happen before any request and are reported in :class:`LoadReport`, never in the per-token
statistics.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from fate_edge.fetch.transfer import Copier
from fate_edge.format.blob import file_identity, mark_verified
from fate_edge.format.store import ExpertStore, decode_expert
from fate_edge.runtime.cache import ExpertCache
from fate_edge.runtime.cache.factory import Resident, precision_name
from fate_edge.runtime.scheduler_stats import SchedulerStats
from fate_edge.sizes import format_bytes


@dataclass
class LoadReport:
    """What the engine read and kept at load, apart from what requests read."""

    resident_layer: int | None = None  # the MoE layer held whole from load to close (Fate's first layer)
    resident_bits: int | None = None  # its precision (16: full precision)
    note: str = ""  # why the resident layer is not in full precision, or not resident at all
    reads: int = 0  # expert blobs read at load
    bytes_read: int = 0
    seconds: float = 0.0
    experts: dict[int, list[int]] = field(default_factory=dict)  # MoE layer → experts cached at load

    def describe(self) -> str:
        first = (
            f"layer {self.resident_layer} resident as {precision_name(self.resident_bits)}"
            if self.resident_layer is not None and self.resident_bits
            else "no resident layer"
        )
        return (
            f"{first}{f' ({self.note})' if self.note else ''}; cache filled at load: {self.reads} experts, "
            f"{format_bytes(self.bytes_read)} in {self.seconds:.2f} s"
        )


def preload_choice(
    slots: dict[int, int], num_experts: int, popularity: Mapping[int, Sequence[int]] | None = None
) -> dict[int, list[int]]:
    """Per MoE layer, the experts to cache at load: all of a layer that fits whole, else its ``slots`` most
    used (calibration counts, ties to the lower id) or, without counts, its ``slots`` lowest-numbered."""
    out = {}
    for layer, s in sorted(slots.items()):
        s = min(s, num_experts)
        counts = (popularity or {}).get(layer)
        if s < num_experts and counts is not None and len(counts) == num_experts:
            out[layer] = sorted(sorted(range(num_experts), key=lambda e: (-counts[e], e))[:s])
        else:
            out[layer] = list(range(s))
    return out


def global_choice(
    capacity: int, moe_layers: Sequence[int], num_experts: int, popularity: Mapping[int, Sequence[int]] | None = None
) -> dict[int, list[int]]:
    """One partition for all layers (``global`` allocation): the ``capacity`` most used experts across layers by
    the calibration counts (each layer routes the same number of assignments per token, so counts compare
    across layers; ties to the shallower layer, then the lower id); without counts, the same number per layer,
    lowest-numbered first (:func:`preload_choice` over uniform slots)."""
    if not popularity or any(len(popularity.get(layer, ())) != num_experts for layer in moe_layers):
        from fate_edge.runtime.cache.allocation import uniform

        return preload_choice(uniform(capacity, moe_layers, num_experts), num_experts)
    ranked = sorted(
        ((layer, e) for layer in moe_layers for e in range(num_experts)),
        key=lambda key: (-popularity[key[0]][key[1]], key[0], key[1]),
    )
    out: dict[int, list[int]] = {}
    for layer, e in sorted(ranked[:capacity]):
        out.setdefault(layer, []).append(e)
    return out


def first_used(calls: Sequence[tuple[int, Sequence[int]]], capacity: int) -> dict[int, list[int]]:
    """The oracle's warm start: the first ``capacity`` distinct experts the recorded request uses, in order of
    first use (Belady's choice for an empty cache), grouped per MoE layer. Any policy may fill its cache at
    load (Fate does), so a bound that started cold could be beaten."""
    seen: dict[int, list[int]] = {}
    n = 0
    for layer, experts in calls:
        for e in experts:
            if n >= capacity:
                return seen
            if int(e) not in seen.setdefault(int(layer), []):
                seen[int(layer)].append(int(e))
                n += 1
    return seen


def read_verified(store: ExpertStore, layer: int, expert: int, bits: int) -> bytearray:
    """One blob's bytes, checked against its CRC (later reads of it then skip the check)."""
    ref = store.ref(layer, expert, bits)
    with open(ref.path, "rb") as f:
        f.seek(ref.offset)
        data = f.read(ref.length)
        mark_verified(ref, data, file_identity(f.fileno()))
    return bytearray(data)


def preload(
    cache: ExpertCache,
    store: ExpertStore,
    choice: dict[int, list[int]],
    bits: int,
    resident: Resident | None,
    dtype: torch.dtype,
    copier: Copier,
    report: LoadReport | None = None,
) -> LoadReport:
    """Read, decode and cache ``choice`` (the resident layer at its own precision, the rest at ``bits``);
    stops at a layer the cache refuses (its partition is full). The resident layer goes first, while the
    rest of the cache is still empty."""
    report = report or LoadReport()
    t0 = time.perf_counter()
    first = [resident.layer] if resident is not None and resident.layer in choice else []
    for layer in first + [lay for lay in choice if lay not in first]:
        b = resident.bits if resident is not None and first and layer == first[0] else bits
        report.experts[layer] = []
        for e in choice[layer]:
            if not _load_one(cache, store, layer, e, b, dtype, copier, report):
                break
    copier.drain()
    report.seconds += time.perf_counter() - t0
    return report


def _load_one(
    cache: ExpertCache,
    store: ExpertStore,
    layer: int,
    expert: int,
    bits: int,
    dtype: torch.dtype,
    copier: Copier,
    report: LoadReport,
) -> bool:
    blob = read_verified(store, layer, expert, bits)
    report.reads += 1
    report.bytes_read += len(blob)
    tensor, event = copier.upload(memoryview(blob), demand=True)
    copier.release_after(event, lambda: blob)  # holds the host bytes until the copy has landed
    weights = decode_expert(tensor, store.precisions[bits], dtype)
    if not cache.insert((layer, expert), weights, weights.nbytes, bits):
        return False
    report.experts[layer].append(expert)
    return True


class Reader(Protocol):
    """The scheduler's serving path, as :func:`read_whole_model` drives it."""

    cache: ExpertCache | None
    stats: SchedulerStats  # what it read: misses and their bytes

    def stream_groups(self, layer: int, expert_ids: Iterable[int]) -> Iterator[Sequence[tuple[int, object]]]: ...

    def end_layer(self, layer: int) -> None: ...


def read_whole_model(reader: Reader, layers: Sequence[int], num_experts: int, report: LoadReport) -> None:
    """Every expert not cached yet read through the scheduler's own path, layer by layer, for a cache that holds
    the whole model: as llama.cpp and Ollama load a model that fits, so the first prompt reads nothing. The reads
    land where a request's would (zero-copy: the pool's huge-page buffers the cache keeps), not in copies."""
    t0, misses, read = time.perf_counter(), reader.stats.misses, reader.stats.demand_bytes
    cache = reader.cache
    assert cache is not None  # a cache that holds the model
    for layer in layers:
        ids = [e for e in range(num_experts) if (layer, e) not in cache]
        for group in reader.stream_groups(layer, ids):
            report.experts.setdefault(layer, []).extend(e for e, _ in group)
        reader.end_layer(layer)
    report.reads += reader.stats.misses - misses  # the reads as the scheduler counted them (blob bytes, not slots)
    report.bytes_read += reader.stats.demand_bytes - read
    report.seconds += time.perf_counter() - t0
