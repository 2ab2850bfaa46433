"""The host tier (runtime.host_tier): experts' blobs in host memory between the store and a discrete GPU's cache.

A device miss the tier holds is served from it with no store read; the tier admits and evicts by the run's own
eviction policy; its slab is charged to the host budget of the memory account; on one memory (a CPU, a Jetson) there
is none. A CPU-only torch has no discrete GPU, so the engine runs here with its memory declared discrete (what
``is_unified`` answers on a CUDA desktop): the same planning, scheduling and tier code, with the CPU copier in place of
the CUDA one and a plain slab in place of a pinned one."""

import shutil
import time

import pytest
from _corrupt import flip_byte
from fate_edge.devices.profile import load_profile

from fate_edge.errors import BudgetError, CorruptBlobError
from fate_edge.format.blob import ALIGN
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.format.store import ExpertStore
from fate_edge.model.arch import load_config
from fate_edge.runtime.budget import plan_budget
from fate_edge.runtime.cache import AccessInfo
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge.runtime.generate import GenerateConfig
from fate_edge.runtime.held_bytes import held_bytes
from fate_edge.runtime.host_tier import HostTier, host_tier_bytes
from fate_edge.runtime.memory_tiers import is_unified, plan_tiers
from fate_edge.runtime.policy import get_policy

INFO = AccessInfo(layer_now=0, num_layers=8)


@pytest.fixture(scope="module")
def store(tmp_path_factory, bundled_dir):
    out = tmp_path_factory.mktemp("host-tier") / "s"
    convert(bundled_dir, out, ConvertOptions.full(bits=4, keep_bf16=False), progress=False)
    return out


@pytest.fixture
def discrete(monkeypatch):
    """The engine's memory as a discrete GPU's: a device budget and a host budget (this host has no GPU)."""
    monkeypatch.setattr(Engine, "_unified", property(lambda self: False))


def _tier(slots: int, slot: int = 64, eviction: str = "lru") -> HostTier:
    return HostTier(slots * slot, slot, get_policy("lru").with_(eviction=eviction), [0, 1], 4)


def test_blobs_are_held_in_slots_of_one_slab_and_evicted_by_the_policy():
    tier = _tier(2)
    assert tier.slots == 2 and tier.held_bytes == tier.slab.untyped_storage().nbytes() == 128
    a, b, c = (bytes([i]) * (40 + i) for i in (1, 2, 3))
    assert tier.admit((0, 0), memoryview(a), 4) and tier.admit((0, 1), memoryview(b), 4)
    assert bytes(tier.blob((0, 0))) == a and bytes(tier.blob((0, 1))) == b
    tier.access((0, 0), True, INFO)  # LRU: (0, 1) is now the least recently used
    assert tier.admit((1, 0), memoryview(c), 4)
    assert (0, 1) not in tier and bytes(tier.blob((1, 0))) == c and bytes(tier.blob((0, 0))) == a
    tier.pin((0, 0))
    tier.pin((1, 0))
    assert not tier.admit((1, 1), memoryview(a), 4)  # every slot pinned: refused, nothing overwritten
    assert tier.stats.refused == 1 and bytes(tier.blob((0, 0))) == a
    assert tier.holds((0, 0), 4) and not tier.holds((0, 0), 8)
    with pytest.raises(ValueError, match="holds no expert"):
        HostTier(10, 64, get_policy("lru"), [0], 4)


def test_a_slot_is_not_overwritten_while_its_copy_to_the_device_is_in_flight():
    class Event:  # a DMA that lands when waited for
        def __init__(self):
            self.waited = False

        def synchronize(self):
            time.sleep(0.01)
            self.waited = True

    tier = _tier(1)
    tier.admit((0, 0), memoryview(b"x" * 64), 4)
    event = Event()
    tier.copying((0, 0), event)
    assert tier.admit((0, 1), memoryview(b"y" * 64), 4)  # evicts (0, 0) and reuses its slot ...
    assert event.waited  # ... only once the copy out of it has landed
    assert bytes(tier.blob((0, 1))) == b"y" * 64


def test_a_read_reserves_its_slot_which_holds_the_blob_only_once_filled():
    tier = _tier(2, slot=ALIGN)
    assert tier.direct and tier.slab.data_ptr() % ALIGN == 0
    view = tier.reserve((0, 0), ALIGN, 4)
    assert view is not None and len(view) == ALIGN
    assert (0, 0) not in tier and not tier.holds((0, 0), 4)  # not valid until the read lands
    assert tier.reserve((0, 0), ALIGN, 4) is None and not tier.admit((0, 0), memoryview(b"x"), 4)
    other = tier.reserve((0, 1), ALIGN, 4)
    assert other is not None and tier.reserve((1, 0), ALIGN, 4) is None  # both slots reserved: nothing evicted
    view[:3] = b"abc"
    assert not tier.fill((0, 0), 3, other)  # not its reservation
    assert tier.fill((0, 0), 3, view) and bytes(tier.blob((0, 0))) == b"abc" and tier.stats.read_into == 1
    tier.abandon((0, 1), other)  # its read failed: the slot is free again, nothing held
    assert (0, 1) not in tier and len(tier) == 1
    assert tier.stats.staged == 0 and tier.stats.admitted == 1
    assert tier.reserve((1, 0), ALIGN, 4) is not None and (0, 0) in tier  # its slot taken again, nothing evicted
    assert _tier(2, slot=64).reserve((0, 0), 64, 4) is None  # unaligned slots: staged and copied in


def test_the_host_tier_collapses_into_the_one_budget_on_one_memory():
    jetson, desktop = load_profile("jetson-orin-nano-8gb"), load_profile("desktop-rtx4090")
    gb = 1_000_000_000
    assert host_tier_bytes("auto", is_unified("cuda", jetson), 5 * gb, 6 * gb) == 0
    assert host_tier_bytes("4GB", is_unified("cuda", jetson), 5 * gb, 6 * gb) == 0
    assert host_tier_bytes("auto", is_unified("cuda", desktop), 5 * gb, 6 * gb) == 3 * gb  # half the free memory
    assert host_tier_bytes("auto", False, 2 * gb, 6 * gb) == 2 * gb  # every expert
    assert host_tier_bytes("1GB", False, 2 * gb, 6 * gb) == gb
    plan = plan_budget(gb, get_policy("fate"), 4_600_000, 4_612_096)
    one = plan_tiers(plan, unified=True)
    assert one.host_tier == 0 and one.in_host_memory == gb and one.in_device_memory == 0
    staged = plan_budget(gb, get_policy("fate"), 4_600_000, 4_612_096, staging_held=8 << 20)
    two = plan_tiers(staged, False, 2 * gb)
    assert two.host_tier == 2 * gb and two.in_host_memory == two.host == staged.host_bytes + 2 * gb
    assert two.in_device_memory == staged.cache_bytes + staged.working_bytes


def _greedy(store, host_memory, policy="lru", budget="1MB", requests=2, check=None):
    cfg = GenerateConfig(max_tokens=12, ignore_eos=True)
    with Engine(EngineConfig(store, budget, policy, host_memory=host_memory)) as e:
        reads: list[tuple[int, bool]] = []  # each store read: (blob offset, whether the host tier held it then)
        key_at = {e.store.ref(layer, x, 4).offset: (layer, x) for layer in e.model.config.moe_layers for x in range(16)}
        tier = e.host_tier
        e.fetch.fault_injector = lambda ref: reads.append((ref.offset, tier is not None and key_at[ref.offset] in tier))
        tokens = [[r.token for r in e.stream(p, cfg)] for p in ["def add(a, b):", "The capital of France"][:requests]]
        if check is not None:
            check(e)
        return e, tokens, reads, len(tier) if tier is not None else 0


@pytest.mark.slow
def test_a_miss_the_host_tier_holds_reads_no_store(store, discrete):
    e, tokens, reads, held = _greedy(store, "16MB")
    assert e.host_tier is not None and held == e.host_tier.stats.admitted > 0
    offsets = [o for o, _ in reads]
    assert len(offsets) == len(set(offsets))  # every expert read from the store at most once, over two requests
    assert not any(held for _, held in reads)
    assert e.stats.host_hits > 0 and e.host_tier.stats.served >= e.stats.host_hits
    base, base_tokens, base_reads, _ = _greedy(store, 0)
    assert base.host_tier is None and len(base_reads) > len(reads)  # without the tier, the same misses re-read
    assert tokens == base_tokens  # the same greedy answers


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["lru", "fate-edge"])
def test_store_reads_land_in_their_tier_slots_with_no_staging_copy(store, discrete, policy):
    e, tokens, _, held = _greedy(store, "16MB", policy=policy)
    tier = e.host_tier
    assert tier is not None and tier.stats.read_into == e.fetch.stats.reads_completed == held > 0
    assert tier.stats.staged == 0 and tier.stats.admitted == tier.stats.read_into
    _, base_tokens, _, _ = _greedy(store, 0, policy=policy)
    assert tokens == base_tokens


@pytest.mark.slow
def test_a_corrupt_blob_read_into_the_tier_is_refused_and_leaves_its_slot_free(store, discrete, tmp_path):
    copy = tmp_path / "s"
    shutil.copytree(store, copy)  # a new file: its blobs are checked on their first read in this process
    experts = ExpertStore(copy)
    layer = load_config(copy).moe_layers[0]
    for x in range(16):  # every expert of the first MoE layer: its first miss reads a damaged blob
        ref = experts.ref(layer, x, 4)
        flip_byte(ref.path, ref.offset + 7)
    cfg = GenerateConfig(max_tokens=4, ignore_eos=True)
    with Engine(EngineConfig(copy, "1MB", "lru", host_memory="16MB")) as e:
        with pytest.raises(CorruptBlobError, match=rf"checksum mismatch for layer {layer} expert .*re-run fate-edge"):
            list(e.stream("def add(a, b):", cfg))
        tier = e.host_tier
        assert tier is not None and not any((layer, x) in tier for x in range(16))
        assert len(tier.cache.entries) == len(tier)  # every slot charged holds a blob: none left reserved


@pytest.mark.slow
def test_with_prefetch_no_read_is_of_a_blob_the_tier_holds(store, discrete):
    e, tokens, reads, _ = _greedy(store, "16MB", policy="fate-edge")
    assert reads and not any(held for _, held in reads) and e.stats.host_hits > 0
    _, base_tokens, _, _ = _greedy(store, 0, policy="fate-edge")
    assert tokens == base_tokens


@pytest.mark.slow
def test_both_budgets_are_charged_what_they_hold(store, discrete):
    slot = ExpertStore(store).precisions[4].slot_bytes

    def check(e):
        tiers, tier = e.account.tiers, e.host_tier
        assert tiers is not None and tier is not None and not tiers.unified
        # the slab holds every expert (the tier asked for more than all of them), charged as allocated
        assert tier.slots == 8 * 16 and tiers.host_tier == tier.held_bytes == tier.slab.untyped_storage().nbytes()
        # store reads land in its slots (O_DIRECT): the slab starts aligned, at most ALIGN - 1 bytes in
        assert tier.held_bytes == tier.slots * slot + ALIGN - 1 and tier.slab.data_ptr() % ALIGN == 0
        assert tiers.host == e.plan.host_bytes + tier.held_bytes == e.account.host_budget
        assert tiers.device == e.plan.cache_bytes + e.plan.working_bytes == e.account.device_budget
        assert e.cache is not None and 0 < e.cache.used_bytes <= e.cache.capacity_bytes
        for entry in e.cache.entries.values():  # each device entry charged what it holds
            assert entry.nbytes == max(entry.expert.nbytes, held_bytes(entry.expert))
        assert e.cache.used_bytes == sum(x.nbytes for x in e.cache.entries.values())

    _greedy(store, "16MB", requests=1, check=check)


def test_one_memory_has_no_host_tier_and_a_tier_that_cannot_fit_is_refused(store, discrete, monkeypatch):
    with pytest.raises(BudgetError, match="holds no expert"):
        Engine(EngineConfig(store, "1MB", "lru", host_memory=100))
    monkeypatch.setattr(Engine, "_unified", property(lambda self: True))
    with Engine(EngineConfig(store, "1MB", "lru", host_memory="16MB")) as e:
        assert e.host_tier is None and e.account.tiers is not None and e.account.tiers.host_tier == 0
        assert e.scheduler.host is None and e.scheduler.zero_copy  # the CPU path as before
