"""Staging buffers whose copies to the device are in flight come back to the pool while a layer waits for reads.

On a GPU a staging buffer returns to the fetch engine's pool only once its copy's event has completed (the DMA may
still read it). With every buffer holding a copy in flight, the readers cannot take one for the reads a layer still
waits on: the scheduler's wait loop must release the copies that have landed, or wait for the oldest, or the
layer blocks forever. Reproduced on the CPU with a copier whose events complete a few milliseconds after the copy
starts, as a DMA does (nothing completes them but time)."""

import threading
import time

import pytest
import torch

from fate_edge.fetch.buffer_pool import BufferPool
from fate_edge.fetch.fetch_engine import FetchEngine
from fate_edge.fetch.transfer import Copier
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.format.store import ExpertStore
from fate_edge.model.arch import load_config
from fate_edge.runtime.policy import get_policy
from fate_edge.runtime.scheduler import Scheduler


class DMAEvent:
    """A copy that lands ``delay`` seconds after it started; query() only reports it (as a CUDA event does)."""

    def __init__(self, delay: float):
        self.at = time.perf_counter() + delay

    def query(self) -> bool:
        return time.perf_counter() >= self.at

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.at - time.perf_counter()))


class DMACopier(Copier):
    """The CUDA copier's bookkeeping on the CPU: the blob is copied, its event completes a little later."""

    device = torch.device("cpu")

    def upload(self, payload: memoryview, demand: bool) -> tuple[torch.Tensor, DMAEvent]:
        self.uploads += 1
        self.bytes += len(payload)
        return torch.frombuffer(payload, dtype=torch.uint8).clone(), DMAEvent(0.005)


@pytest.fixture(scope="module")
def store(tmp_path_factory, bundled_dir):
    out = tmp_path_factory.mktemp("staging") / "s"
    convert(bundled_dir, out, ConvertOptions.full(bits=4, keep_bf16=False), progress=False)
    return out


def test_a_layer_with_every_staging_buffer_in_flight_still_gets_its_reads(store):
    config = load_config(store)
    experts = ExpertStore(store)
    policy = get_policy("load-on-demand-int4")
    pool = BufferPool(1, experts.precisions[policy.bits].slot_bytes)  # one buffer: the first copy holds it
    with FetchEngine(pool, workers=1) as fetch:
        sched = Scheduler(config, experts, fetch, None, policy, copier=DMACopier())
        layer = config.moe_layers[0]
        h = torch.zeros(1, config.hidden_size)
        idx = torch.tensor([[0, 1, 2]])
        served: list[int] = []

        def run() -> None:
            sched.on_route(layer, h, idx, torch.full((1, 3), 1 / 3))
            served.extend(e for e, _ in sched.stream(layer, [0, 1, 2]))
            sched.end_layer(layer)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(timeout=20)
        assert not t.is_alive(), "the layer blocked: no staging buffer came back while it waited for its reads"
        assert sorted(served) == [0, 1, 2]
        sched.copier.drain()
        assert pool.available == pool.count  # every buffer back in the pool


def test_the_reader_cpu_gate_is_off_where_a_gpu_computes(store):
    """fate-edge's prefetch gate weighs a read's reader CPU against the CPU compute it delays; on a GPU the compute
    is not the CPU's, so the width comes from the measured layer and read times alone."""
    config = load_config(store)
    experts = ExpertStore(store)
    policy = get_policy("fate-edge")
    assert policy.prefetch_gate
    pool = BufferPool(4, experts.precisions[policy.bits].slot_bytes)

    class GPUCopier(DMACopier):
        device = torch.device("cuda")

    with FetchEngine(pool, workers=1) as fetch:
        widths = []
        for copier in (DMACopier(), GPUCopier()):
            sched = Scheduler(config, experts, fetch, None, policy, copier=copier)
            sched._layer_time, sched._read_bw = 5e-3, 2e9  # measured: a read lands well within a layer
            widths.append(sched._width())
        assert widths == [0, policy.max_prefetch_width]  # CPU: shut until reads are costed; GPU: the times' width
