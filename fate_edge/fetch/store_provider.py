"""ExpertProvider over an expert store: every routed expert read through the fetch engine on demand.

No cache here (load-on-demand): the cache and the prefetch scheduler wrap this path in later layers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from fate_edge.devices.link import ThrottledLink
from fate_edge.fetch.fetch_engine import BufferPool, FetchEngine, Priority
from fate_edge.format.store import ExpertStore, decode_expert
from fate_edge.model.experts import ExpertProvider


@dataclass
class ProviderStats:
    reads: int = 0
    bytes_read: int = 0
    stall_s: float = 0.0  # time the forward pass waited for reads
    decode_s: float = 0.0  # time turning blobs into callable experts


class StoreExpertProvider(ExpertProvider):
    def __init__(
        self,
        store: ExpertStore,
        bits: int | None = None,
        dtype: torch.dtype = torch.float32,
        engine: FetchEngine | None = None,
        link: ThrottledLink | None = None,
        workers: int = 2,
        direct_io: bool = True,
        device: str = "cpu",
    ):
        self.store = store
        quantized = [b for b in store.bits_available if b < 16]
        self.bits = bits if bits is not None else (max(quantized) if quantized else 16)
        store.precisions.get(self.bits) or store.ref(0, 0, self.bits)  # raises naming the precisions available
        self.dtype = dtype
        self.device = device
        # Buffers for the precision read, not the store's largest (bf16) blob: they are faulted in when made.
        slot = store.precisions[self.bits].slot_bytes
        self.engine = engine or FetchEngine(
            BufferPool(2 * workers, slot), workers=workers, link=link, direct_io=direct_io
        )
        self.stats = ProviderStats()

    def get(self, layer: int, expert: int):
        ref = self.store.ref(layer, expert, self.bits)
        t0 = time.perf_counter()
        req = self.engine.submit(ref, Priority.DEMAND)
        try:
            payload = self.engine.wait(req)
            t1 = time.perf_counter()
            w = decode_expert(payload, self.store.precisions[self.bits], self.dtype, self.device)
        finally:
            self.engine.release(req)
        self.stats.reads += 1
        self.stats.bytes_read += ref.length
        self.stats.stall_s += t1 - t0
        self.stats.decode_s += time.perf_counter() - t1
        return w

    def close(self) -> None:
        self.engine.close()
