"""Prefetched experts are made ready as their reads land, not when their layer asks (``Scheduler.land_early``, the
GPU's default: the copy to the device overlaps compute).

Run on the CPU with a copier whose copies land a few ms after they start, as a DMA does; the order is what is checked:
an expert read ahead for layer i+1 is uploaded, decoded and cached by the end of layer i, and layer i+1 then finds it
cached and counts it a prefetch hit. A prefetch the host tier holds is copied up at once, with no store read."""

import pytest
import torch
from fate_edge.predictors.base import Prediction, Predictor

from fate_edge.fetch.buffer_pool import BufferPool
from fate_edge.fetch.fetch_engine import FetchEngine
from fate_edge.fetch.transfer import Copier
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.format.store import ExpertStore
from fate_edge.model.arch import load_config
from fate_edge.runtime.cache.factory import build_cache
from fate_edge.runtime.host_tier import HostTier
from fate_edge.runtime.policy import PolicyConfig
from fate_edge.runtime.scheduler import Scheduler

AHEAD = [5, 9]  # what the stub predicts for the next layer


class DMAEvent:
    def __init__(self, copier: "DMACopier"):
        self.copier = copier
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


class DMACopier(Copier):
    """The CUDA copier's bookkeeping on the CPU: the blob is copied, and its event completes when waited for."""

    device = torch.device("cpu")

    def upload(self, payload: memoryview, demand: bool) -> tuple[torch.Tensor, DMAEvent]:
        self.uploads += 1
        self.bytes += len(payload)
        return torch.frombuffer(payload, dtype=torch.uint8).clone(), DMAEvent(self)


class Ahead(Predictor):
    def predict(self, layer: int, h: torch.Tensor) -> Prediction:
        targets = self.targets(layer)
        scores = torch.zeros(len(targets), h.shape[0], 16)
        scores[:, :, AHEAD] = torch.tensor([2.0, 1.0])
        return Prediction(targets, scores)


@pytest.fixture(scope="module")
def store(tmp_path_factory, bundled_dir):
    out = tmp_path_factory.mktemp("land") / "s"
    convert(bundled_dir, out, ConvertOptions.full(bits=4, keep_bf16=False), progress=False)
    return out


def _scheduler(store, fetch, on_land: bool, host: HostTier | None = None) -> Scheduler:
    config, experts = load_config(store), ExpertStore(store)
    policy = PolicyConfig("t", eviction="lru", predictor="cross-layer", prefetch_width=2, max_prefetch_width=2)
    entry = experts.precisions[4].slot_bytes
    cache = build_cache(policy, 64 * entry, entry, config.moe_layers, config.num_experts)
    predictor = Ahead(config.moe_layers, lookahead=1)
    return Scheduler(
        config, experts, fetch, cache, policy, predictor, copier=DMACopier(), upload_on_land=on_land, host_tier=host
    )


def _first_layer(sched: Scheduler) -> tuple[int, int]:
    first, second = sched.config.moe_layers[:2]
    h = torch.zeros(1, sched.config.hidden_size)
    sched.begin_forward(1)
    sched.on_route(first, h, torch.tensor([[0, 1]]), torch.full((1, 2), 0.5))
    assert [e for e, _ in sched.stream(first, [0, 1])] in ([0, 1], [1, 0])
    for f in list(sched.prefetches.values()):  # the reads ahead land while layer `first` computes
        f.req.done.wait(10)
    sched.end_layer(first)
    return first, second


@pytest.mark.parametrize("on_land", [True, False])
def test_a_prefetched_expert_is_ready_before_its_layer_runs(store, on_land):
    experts = ExpertStore(store)
    with FetchEngine(BufferPool(6, experts.precisions[4].slot_bytes), workers=1) as fetch:
        sched = _scheduler(store, fetch, on_land)
        _, second = _first_layer(sched)
        assert sched.cache is not None
        ready = [(second, e) in sched.cache for e in AHEAD]
        if not on_land:  # before: still a read in a staging buffer, uploaded only when layer `second` asks
            assert ready == [False, False] and sched.copier.uploads == 2 and len(sched.prefetches) == 2
            return
        assert ready == [True, True] and sched.copier.uploads == 4 and not sched.prefetches
        assert sched.stats.landed_early == 2
        sched.on_route(second, torch.zeros(1, sched.config.hidden_size), torch.tensor([AHEAD]), torch.ones(1, 2) / 2)
        assert not sched.demands  # nothing to read: both are cached
        assert sorted(e for e, _ in sched.stream(second, AHEAD)) == AHEAD
        sched.end_layer(second)
        assert sched.stats.prefetch_hits == 2 and sched.stats.hits == 0 and sched.stats.misses == 2
        assert sched.stats.prefetch_bytes == 2 * experts.ref(second, AHEAD[0], 4).length
        sched.abort()  # the reads ahead for the layer after: dropped, their copies waited for
        assert fetch.pool.available == fetch.pool.count


def test_a_prefetch_the_host_tier_holds_is_copied_up_at_once(store):
    config, experts = load_config(store), ExpertStore(store)
    slot = experts.precisions[4].slot_bytes
    policy = PolicyConfig("t", eviction="lru")
    host = HostTier(32 * slot, slot, policy, config.moe_layers, config.num_experts)
    second = config.moe_layers[1]
    ref = experts.ref(second, AHEAD[0], 4)
    with open(ref.path, "rb") as f:
        f.seek(ref.offset)
        host.admit((second, AHEAD[0]), memoryview(f.read(ref.length)), 4)
    with FetchEngine(BufferPool(6, slot), workers=1) as fetch:
        read: list[int] = []
        fetch.fault_injector = lambda r: read.append(r.offset)
        sched = _scheduler(store, fetch, True, host)
        _first_layer(sched)
        assert sched.cache is not None and (second, AHEAD[0]) in sched.cache and (second, AHEAD[1]) in sched.cache
        assert ref.offset not in read  # copied up from host memory, not read again
        assert len(read) == 3  # the two misses of the first layer and the other prefetch
        assert host.holds((second, AHEAD[1]), 4)  # what the store read lands in the host tier too
