"""Read buffers are faulted in when they are made, and the cache's memory is made at load (spares): a hand-off
takes a spare before it allocates, and the engine makes only as many as its cache has room for after load."""

import gc
import mmap

import psutil
import pytest
from _replay import PROMPT, all_expert_bytes
from test_prefetch_buffers import DECODE, store  # noqa: F401  (the module's converted store fixture)

from fate_edge.fetch.buffer_pool import Buffer, BufferPool
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig

MB = 1 << 20


@pytest.mark.skipif(not hasattr(mmap, "MAP_POPULATE"), reason="MAP_POPULATE is Linux's")
def test_a_buffer_is_resident_before_anything_touches_it():
    proc = psutil.Process()
    gc.collect()  # nothing else frees or takes memory between the two readings
    before = proc.memory_info().rss
    buf = Buffer(64 * MB)
    grown = proc.memory_info().rss - before
    assert grown >= 60 * MB, f"RSS grew {grown / MB:.1f} MB for a 64 MB buffer: its pages were not faulted in"
    buf.view[0] = 1  # still an ordinary writable buffer
    assert buf.view[0] == 1


def test_without_map_populate_a_buffer_is_a_lazy_anonymous_map(monkeypatch):
    """Hosts without MAP_POPULATE (macOS; Windows, whose mmap takes no flags) get the plain mapping: its pages fault
    in on first use."""
    import fate_edge.fetch.buffer_pool as buffer_pool

    monkeypatch.setattr(buffer_pool, "_POPULATE", 0)
    proc = psutil.Process()
    gc.collect()
    before = proc.memory_info().rss
    buf = Buffer(64 * MB)
    assert proc.memory_info().rss - before < 16 * MB
    buf.view[0:3] = b"abc"
    assert bytes(buf.view[0:3]) == b"abc"


def test_hand_offs_take_spares_before_making_buffers():
    pool = BufferPool(2, 4096)
    pool.add_spares(2)
    assert pool.spares == 2
    made = [pool.acquire() for _ in range(2)]
    spare_ids = {id(b) for b in pool._spares}
    pool.hand_off(made[0])
    pool.hand_off(made[1], replacement=Buffer(4096))  # an evicted expert's buffer: no spare needed
    assert (pool.spares, pool.spares_used, pool.recycled, pool.handed_off) == (1, 1, 1, 2)
    assert len(spare_ids & {id(b) for b in pool._free}) == 1  # the spare is now one of the pool's buffers
    third = pool.acquire()
    pool.hand_off(third)
    fourth = pool.acquire()
    pool.hand_off(fourth)  # spares gone: a new buffer, as before
    assert (pool.spares, pool.spares_used, pool.handed_off, pool.available) == (0, 2, 4, 2)


@pytest.mark.parametrize("policy", ["lru", "fate-edge", "fate"])
def test_the_engine_makes_spares_for_the_room_its_cache_has_after_load(store, one_thread, policy):  # noqa: F811
    """As many spares as the cache's free entries after load (what fate fills at load is not counted twice), never
    more than the experts not cached; serving takes them before it makes any buffer."""
    with Engine(EngineConfig(store, int(0.35 * all_expert_bytes(store)), policy)) as engine:
        pool, cache, cfg = engine.fetch.pool, engine.cache, engine.model.config
        if not engine.scheduler.zero_copy:
            pytest.skip(f"{policy} does not hand read buffers to its cache")
        uncached = len(cfg.moe_layers) * cfg.num_experts - len(cache.entries)
        room = sum(
            max(0, cache.capacity[p] - cache.used[p]) // pool.size
            for p in cache.capacity
            if p not in cache._other_sizes
        )
        assert pool.spares == min(room, uncached)
        assert pool.spares * pool.size + cache.used_bytes <= cache.capacity_bytes
        made = pool.spares
        engine.generate_text(PROMPT, DECODE)
        needed = pool.handed_off - pool.recycled  # hand-offs with no evicted buffer to put in place
        assert pool.spares_used == min(made, needed)
        assert needed - pool.spares_used == 0 or pool.spares == 0  # a buffer is made only once the spares are gone
        assert engine.stats.misses > 0 and (made == 0 or pool.spares_used > 0)


def test_a_budget_past_every_expert_makes_no_more_spares_than_experts(store, one_thread):  # noqa: F811
    with Engine(EngineConfig(store, 4 * all_expert_bytes(store), "lru")) as engine:
        cfg = engine.model.config
        assert engine.fetch.pool.spares <= len(cfg.moe_layers) * cfg.num_experts


def test_a_store_provider_sizes_its_buffers_for_the_precision_it_reads(store):  # noqa: F811
    """Its buffers are faulted in when made: sized for the store's largest blob they would commit memory a read of
    a smaller precision never uses (bf16 blobs are 3.6x int4's)."""
    from fate_edge.fetch.store_provider import StoreExpertProvider
    from fate_edge.format.store import ExpertStore

    s = ExpertStore(store)
    prov = StoreExpertProvider(s, bits=2, workers=1)
    try:
        assert prov.engine.pool.size == s.precisions[2].slot_bytes < s.max_blob_bytes
        layer = s.index["moe_layers"][0]
        assert prov.get(layer, 0) is not None
    finally:
        prov.close()
