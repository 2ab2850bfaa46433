"""Moving fetched blobs from host staging buffers to the compute device, with correct synchronisation.

The fetch engine reads a blob into a staging buffer; the scheduler then calls :meth:`Copier.upload`
and decodes the expert from the tensor it returns. Two implementations share the bookkeeping:

* :class:`CPUCopier`: the blob is copied out of the staging buffer at once, so the buffer can go back
  to the pool immediately.
* :class:`CUDACopier`: the copy runs asynchronously on a dedicated copy stream (demand misses on a
  higher-priority stream than prefetches), records a CUDA event, and the compute stream waits on that
  event before the expert's first use. The staging buffer returns to the pool only once the event has
  completed, never while the DMA may still read it. (Fate's reference code had no such event: a kernel
  could read an expert before its copy landed.)

Buffers whose copies are still in flight stay in :attr:`Copier.in_flight` and count against the budget
because they belong to the fetch engine's preallocated pool. Whoever waits for a read polls them (the scheduler's
wait loop): with every buffer copying, no reader could start the read it waits for.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class PendingRelease:
    event: Any  # object with .query() -> bool (a torch.cuda.Event, or a test double)
    release: Callable[[], object]  # its return value is ignored


class Copier:
    """Base bookkeeping: staging buffers are released only after their copy's event has completed."""

    device: torch.device

    def __init__(self) -> None:
        self.in_flight: list[PendingRelease] = []
        self.uploads = 0
        self.bytes = 0
        self._timed: list[tuple[int, float]] = []  # (bytes, seconds) of copies that have completed

    def timings(self) -> list[tuple[int, float]]:
        """(bytes, seconds) of each copy completed since the last call: the link's measured speed."""
        out, self._timed = self._timed, []
        return out

    def upload(self, payload: memoryview, demand: bool) -> tuple[torch.Tensor, Any]:
        """Start moving ``payload`` to the device; returns (device uint8 tensor, completion event or None)."""
        raise NotImplementedError

    def release_after(self, event: Any, release: Callable[[], object]) -> None:
        """Run ``release`` (give the staging buffer back) once ``event`` has completed."""
        if event is None or event.query():
            release()
        else:
            self.in_flight.append(PendingRelease(event, release))
        self.poll()

    def poll(self) -> int:
        """Release the buffers whose copies have finished; returns how many are still in flight."""
        still = []
        for p in self.in_flight:
            if p.event.query():
                p.release()
            else:
                still.append(p)
        self.in_flight = still
        return len(still)

    def wait_oldest(self) -> None:
        """Wait for the oldest outstanding copy and release its buffer (then any others that have landed)."""
        if self.in_flight:
            oldest = self.in_flight.pop(0)
            oldest.event.synchronize()
            oldest.release()
            self.poll()

    def drain(self) -> None:
        """Wait for every outstanding copy and release its buffer."""
        for p in self.in_flight:
            p.event.synchronize()
            p.release()
        self.in_flight = []


class CPUCopier(Copier):
    def __init__(self) -> None:
        super().__init__()
        self.device = torch.device("cpu")

    def upload(self, payload: memoryview, demand: bool) -> tuple[torch.Tensor, Any]:
        self.uploads += 1
        self.bytes += len(payload)
        t0 = time.perf_counter()
        out = torch.frombuffer(payload, dtype=torch.uint8).clone()  # private copy: buffer free at once
        self._timed.append((len(payload), time.perf_counter() - t0))
        return out, None


class CUDACopier(Copier):
    def __init__(self, device: str | torch.device = "cuda") -> None:
        super().__init__()
        self.device = torch.device(device)
        # hi is the numerically lowest = highest priority; torch's stubs declare this static method as an instance one
        lo, hi = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]
        self.demand_stream = torch.cuda.Stream(self.device, priority=hi)
        self.prefetch_stream = torch.cuda.Stream(self.device, priority=lo)
        self._timing: list[tuple[int, Any, Any]] = []  # copies whose time is not read yet: (bytes, start, end)

    def timings(self) -> list[tuple[int, float]]:
        still = []
        for nbytes, start, end in self._timing:
            if end.query():
                self._timed.append((nbytes, start.elapsed_time(end) / 1e3))
            else:
                still.append((nbytes, start, end))
        self._timing = still
        return super().timings()

    def upload(self, payload: memoryview, demand: bool) -> tuple[torch.Tensor, Any]:
        src = torch.frombuffer(payload, dtype=torch.uint8)  # a view of the pinned staging buffer
        stream = self.demand_stream if demand else self.prefetch_stream
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream):
            dst = torch.empty(src.numel(), dtype=torch.uint8, device=self.device)
            start = torch.cuda.Event(enable_timing=True)  # timed: the link's speed (runtime.miss_rule)
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream)
        self._timing.append((len(payload), start, event))
        compute.wait_event(event)  # kernels that decode or use this expert start after the copy lands
        dst.record_stream(compute)  # allocated on the copy stream, used on compute: keep it alive for both
        self.uploads += 1
        self.bytes += len(payload)
        return dst, event


def make_copier(device: str | torch.device) -> Copier:
    device = torch.device(device)
    return CUDACopier(device) if device.type == "cuda" else CPUCopier()
