"""Read buffers for prefetches within the budget: a share of the pool that demand reads never lose, and the
zero-copy hand-off of a read buffer to the cache (the blob is read into the memory that becomes the cached
expert). Counters and bytes, never timings."""

import os
import zlib

import pytest
import torch
from _replay import PROMPT, all_expert_bytes

from fate_edge import GenerateConfig
from fate_edge.fetch.fetch_engine import BufferPool, FetchEngine, Priority
from fate_edge.format.blob import BlobRef
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.runtime.budget import plan_budget
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge.runtime.policy import PRESETS

BLOB = 64 * 1024
DECODE = GenerateConfig(max_tokens=12, ignore_eos=True)


@pytest.fixture()
def blobs(tmp_path):
    path = tmp_path / "experts-4.bin"
    refs, data = [], []
    with path.open("wb") as f:
        for i in range(8):
            d = os.urandom(BLOB - 100)
            refs.append(BlobRef(str(path), f.tell(), len(d), zlib.crc32(d), layer=i // 4, expert=i % 4, bits=4))
            f.write(d + b"\0" * 100)
            data.append(d)
    return refs, data


def test_prefetches_never_take_the_buffers_kept_for_demand(blobs):
    refs, _ = blobs
    with FetchEngine(BufferPool(4, BLOB), workers=2, demand_reserve=2) as eng:
        ahead = [eng.submit(r, Priority.NEXT_LAYER) for r in refs[:4]]
        for r in ahead[:2]:
            eng.wait(r, timeout=10)  # read, and holding their buffers until consumed
        assert [r.state for r in ahead] == ["done", "done", "queued", "queued"]  # the prefetches' share is 2
        demands = [eng.submit(r, Priority.DEMAND) for r in refs[4:6]]
        for r in demands:  # both demand reads find a buffer while the prefetches hold theirs
            eng.wait(r, timeout=10)
            eng.release(r)
        assert [r.state for r in ahead[2:]] == ["queued", "queued"]
        eng.release(ahead[0])  # one prefetch consumed: the next one starts
        eng.wait(ahead[2], timeout=10)
        assert ahead[3].state == "queued"
        eng.promote(ahead[3], Priority.DEMAND)  # needed now: a demand read, whatever the prefetches hold
        eng.wait(ahead[3], timeout=10)
        for r in (ahead[1], ahead[2], ahead[3]):
            eng.release(r)
        assert eng.pool.available == 4


def test_a_handed_off_buffer_keeps_its_blob_and_the_pool_its_size(blobs):
    refs, data = blobs
    with FetchEngine(BufferPool(2, BLOB), workers=1) as eng:
        req = eng.submit(refs[0])
        eng.wait(req, timeout=10)
        kept = eng.hand_off(req)
        assert bytes(kept.view[: refs[0].length]) == data[0]  # the bytes were read straight into it
        assert (eng.pool.count, eng.pool.available, eng.pool.handed_off) == (2, 2, 1)
        for i in range(1, 6):  # the pool keeps reading into its own buffers, never into the kept one
            r = eng.submit(refs[i])
            assert bytes(eng.wait(r, timeout=10)) == data[i]
            eng.release(r)
        assert bytes(kept.view[: refs[0].length]) == data[0]


def test_small_budgets_still_get_one_layer_of_prefetch_buffers():
    entry = slot = 40_960
    fate = PRESETS["fate"]
    tight = plan_budget(3 * slot + 8 * slot, fate, entry, slot, top_k=2)  # a tenth of 8 slots: none
    assert tight.pool_buffers == 2 + 2 and tight.demand_buffers == 2
    assert tight.pool_bytes + tight.working_bytes + tight.cache_bytes == tight.budget
    assert plan_budget(3 * slot + slot, fate, entry, slot, top_k=2).pool_buffers == 2 + 1  # what fits
    assert plan_budget(3 * slot + 8 * slot, PRESETS["lru"], entry, slot).pool_buffers == 2  # nothing predicted


@pytest.fixture(scope="module")
def store(tmp_path_factory, bundled_dir):
    out = tmp_path_factory.mktemp("buffers") / "tiny-int4-int2"
    return convert(bundled_dir, out, ConvertOptions.full(bits=4, cold_bits=2, keep_bf16=False), progress=False)


def _tensors(obj, depth: int = 3):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth and hasattr(obj, "__dict__"):
        for v in vars(obj).values():
            yield from _tensors(v, depth - 1)


def resident_bytes(engine: Engine) -> int:
    """Bytes the cache's experts really hold (each distinct storage once) plus every read buffer of the pool and
    the spares not handed out yet (memory made, and faulted in, at load)."""
    storages = {}
    for entry in engine.cache.entries.values():
        for t in _tensors(entry.expert):
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    pool = engine.fetch.pool
    return sum(storages.values()) + (pool.count + pool.spares) * pool.size


@pytest.mark.parametrize("policy", ["fate", "fate-edge", "lru"])
@pytest.mark.parametrize("share", [0.20, 0.35])
def test_cache_and_read_buffers_stay_within_the_budget_at_every_step(store, one_thread, policy, share):
    """Measured at every routing call and every layer's end: the memory the cached experts really hold (a
    handed-off expert keeps its whole read buffer) plus all read buffers, in flight or not, plus the one
    expert being computed, never exceeds the budget."""
    with Engine(EngineConfig(store, int(share * all_expert_bytes(store)), policy)) as engine:
        seen = []
        end_layer = engine.scheduler.end_layer

        def at_end(layer):
            end_layer(layer)
            seen.append(resident_bytes(engine))

        engine.scheduler.end_layer = at_end
        engine.model.observers.insert(0, lambda *a: seen.append(resident_bytes(engine)))
        engine.generate_text(PROMPT, DECODE)
        assert engine.fetch.pool.handed_off > 0  # the zero-copy path ran
        assert len(seen) > 100 and max(seen) + engine.plan.working_bytes <= engine.budget


def test_cached_experts_live_in_their_read_buffers(store, one_thread):
    """Zero-copy: every expert cached while serving lives in a whole read buffer (a copy would be the blob's
    length), and only the experts the cache did not keep were copied on the main thread. What fate caches at load
    (preload.py: its resident first layer, the cache's fill) is decoded before any request, outside the read
    buffers: plain tensors charged their own bytes."""
    with Engine(EngineConfig(store, int(0.35 * all_expert_bytes(store)), "fate")) as engine:
        at_load = {key: entry.expert for key, entry in engine.cache.entries.items()}
        assert at_load  # fate fills its cache at load
        engine.generate_text(PROMPT, DECODE)
        pool, copier, s = engine.fetch.pool, engine.scheduler.copier, engine.stats
        served = 0
        for key, entry in engine.cache.entries.items():
            sizes = {t.untyped_storage().nbytes() for t in _tensors(entry.expert)}
            if at_load.get(key) is entry.expert:
                assert pool.size not in sizes and entry.nbytes == sum(t.nbytes for t in _tensors(entry.expert))
            else:
                served += 1
                assert sizes == {pool.size}
                assert entry.nbytes == pool.size  # charged the whole buffer
        assert served
        assert copier.uploads + pool.handed_off + engine.scheduler.lent_reads == s.misses + s.prefetch_hits
        assert pool.handed_off >= served


def test_uncached_experts_are_computed_in_their_read_buffers(store, one_thread):
    """load-on-demand keeps nothing: each expert is computed in its read buffer (no copy on the main thread, as a
    device computes from the memory its DMA filled), which goes back to the pool once the layer has used it; the
    answer is the copied path's (the resident run's, tests/test_engine.py)."""
    with Engine(EngineConfig(store, "4MB", "load-on-demand-int4")) as engine:
        pool = engine.fetch.pool
        seen: list[set[int]] = []  # per expert served: the storage sizes of its tensors
        inner = engine.scheduler._consume

        def consume(*a):
            expert = inner(*a)
            seen.append({t.untyped_storage().nbytes() for t in _tensors(expert)})
            return expert

        engine.scheduler._consume = consume
        text, _ = engine.generate_text(PROMPT, DECODE)
        assert engine.stats.misses > 0 and len(seen) == engine.stats.misses
        assert engine.scheduler.copier.uploads == 0  # nothing copied out
        assert all(sizes == {pool.size} for sizes in seen)  # every expert's tensors are views of a read buffer
        assert pool.handed_off == 0 and pool.available == pool.count  # every buffer back in the pool
    with Engine(EngineConfig(store, "4MB", "load-on-demand-int4")) as copied:
        copied.scheduler.lends = False  # the copy-out path, for the same answer
        assert copied.generate_text(PROMPT, DECODE)[0] == text
        assert copied.scheduler.copier.uploads > 0


def test_an_expert_the_cache_declines_is_computed_in_its_read_buffer(store, one_thread):
    """A cache that declines some reads (the link-bound device row: next-use declines a miss expected back later than
    its victim, and the prompt's reads enter only free room) computes those experts in their read buffers, as
    load-on-demand does, instead of copying each out into fresh memory: nothing is uploaded, every buffer not kept
    by the cache is back in the pool, and the text is lru's."""
    from fate_edge.planning.device_presets import for_device

    budget = int(0.20 * all_expert_bytes(store))
    with Engine(EngineConfig(store, budget, "lru")) as ref:
        want = ref.generate_text(PROMPT, DECODE)[0]
    with Engine(EngineConfig(store, budget, for_device(PRESETS["fate-edge"], "orin-nano"))) as engine:
        text, _ = engine.generate_text(PROMPT, DECODE)
        pool, sched, s = engine.fetch.pool, engine.scheduler, engine.stats
        assert text == want
        assert sched.lent_reads > 0 and pool.handed_off > 0  # some declined (computed in place), some kept
        assert sched.copier.uploads == 0
        assert sched.lent_reads + pool.handed_off == s.misses + s.prefetch_hits
        assert pool.available == pool.count  # every lent buffer came back


def test_an_uncached_expert_served_by_get_keeps_its_buffer_until_the_layer_ends(store, one_thread):
    """Scheduler.get returns the expert after its stream has ended: its read buffer must stay out of the pool (no
    read may overwrite it) until end_layer."""
    with Engine(EngineConfig(store, "4MB", "load-on-demand-int4")) as engine:
        sched, pool = engine.scheduler, engine.fetch.pool
        layer = engine.model.config.moe_layers[0]
        expert = sched.get(layer, 0)
        assert {t.untyped_storage().nbytes() for t in _tensors(expert)} == {pool.size}
        assert pool.available == pool.count - 1
        sched.end_layer(layer)
        assert pool.available == pool.count


def test_evicted_buffers_are_reused_only_when_no_expert_points_into_them(store, one_thread):
    """An evicted expert's read buffer becomes the pool's next buffer (no new memory for the reader to fault
    in), unless something still holds that expert: then its bytes must stay as they are."""
    with Engine(EngineConfig(store, int(0.20 * all_expert_bytes(store)), "lru")) as engine:
        engine.generate_text(PROMPT, DECODE)
        pool = engine.fetch.pool
        assert engine.cache.evictions > 0 and pool.recycled > 0
        held = {key: entry.expert for key, entry in engine.cache.entries.items()}  # a caller keeps experts
        before = {key: [t.clone() for t in _tensors(expert)] for key, expert in held.items()}
        engine.generate_text("import numpy as np\nclass Model:\n    def forward(self, x):", DECODE)
        evicted = [key for key in held if key not in engine.cache]
        assert evicted  # evicted while held ...
        for key in evicted:  # ... and their buffers not reused
            assert all(torch.equal(a, b) for a, b in zip(before[key], _tensors(held[key])))
