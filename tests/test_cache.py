"""Known-answer tests of the eviction policies and the cache's hard budget."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fate_edge.runtime.cache import ARC, LCU, LFU, LRU, AccessInfo, Belady, DecayedPopularity, ExpertCache
from fate_edge.runtime.cache.allocation import cost_aware, shallow_favoring, uniform


def run(policy, capacity, keys, layer_of=lambda k: 0):
    """Replay ``keys`` (expert ids of one layer) through a cache of ``capacity`` entries; hit/miss per access."""
    cache = ExpertCache({0: capacity}, lambda part, cap: policy, entry_bytes=1, partition_of=lambda key: 0)
    out = []
    for k in keys:
        key = (layer_of(k), k)
        hit = key in cache
        cache.access(key, hit, AccessInfo())
        if not hit:
            declined = cache.bypassed
            assert cache.insert(key, object(), 1, 4) or cache.bypassed == declined + 1  # stored, or bypassed
        out.append(hit)
        assert cache.used_bytes <= capacity
    return out, {k for _, k in cache.entries}


def test_lru_evicts_least_recent():
    hits, resident = run(LRU(), 2, [1, 2, 1, 3])
    assert hits == [False, False, True, False] and resident == {1, 3}


def test_lfu_evicts_least_frequent():
    hits, resident = run(LFU(), 2, [1, 1, 2, 3])
    assert resident == {1, 3}
    hits, resident = run(LFU(), 2, [1, 2, 2, 1, 1, 3, 4])  # 2 and 1 are frequent; 3 is the newcomer
    assert resident == {1, 4}


def test_arc_keeps_frequent_keys_through_a_scan():
    # 1 is used twice (moves to T2); a one-pass scan 2,3,4,5 must not push it out, unlike LRU.
    seq = [1, 1, 2, 3, 4, 5, 1]
    arc_hits, _ = run(ARC(2), 2, seq)
    lru_hits, _ = run(LRU(), 2, seq)
    assert arc_hits[-1] is True and lru_hits[-1] is False


def test_arc_ghost_hit_adapts_towards_recency():
    arc = ARC(2)
    run(arc, 2, [1, 2, 3, 1])  # 1 was evicted from T1 into ghost B1, then requested again
    assert arc.p > 0


def test_belady_evicts_farthest_next_use():
    seq = [1, 2, 3, 1, 2, 3, 1, 2]
    hits, _ = run(Belady([(0, k) for k in seq]), 2, seq)
    # MIN with bypass on this trace: 3 and then 3 again are needed later than both residents, so neither is cached:
    # hits at positions 3, 4, 6, 7 (MIN admitting every miss: 3)
    assert hits == [False, False, False, True, True, False, True, True]
    assert sum(run(LRU(), 2, seq)[0]) == 0  # LRU thrashes on a cyclic trace
    for policy in (LFU(), ARC(2), DecayedPopularity()):
        assert sum(run(policy, 2, seq)[0]) <= sum(hits)  # nothing beats the clairvoyant bound


def test_popularity_seeded_from_calibration():
    pop = DecayedPopularity(decay=0.9, seed_counts={(0, 1): 50.0})
    _, resident = run(pop, 2, [1, 2, 3, 4])
    assert 1 in resident  # calibration says expert 1 is popular: it survives the newcomers


def test_lcu_prefers_experts_of_the_next_layers():
    lcu = LCU()
    cache = ExpertCache({0: 2}, lambda part, cap: lcu, entry_bytes=1, partition_of=lambda key: 0)
    # Token 1 uses (1, 0) and (5, 0); token 2 at layer 2 needs room for (2, 3).
    for layer, e in [(1, 0), (5, 0)]:
        cache.access((layer, e), False, AccessInfo(layer_now=layer, num_layers=8))
        cache.insert((layer, e), object(), 1, 4)
    cache.access((0, 9), False, AccessInfo(layer_now=0, num_layers=8))  # new forward pass starts
    cache.access((2, 3), False, AccessInfo(layer_now=2, num_layers=8))
    assert cache.insert((2, 3), object(), 1, 4)
    # Layer 1 is 7 layers away from layer 2 (next token), layer 5 is 3 away: LCU evicts (1, 0).
    assert (5, 0) in cache and (1, 0) not in cache


def test_pinned_entries_are_never_evicted_and_budget_holds():
    cache = ExpertCache({0: 2}, lambda part, cap: LRU(), entry_bytes=1, partition_of=lambda key: 0)
    for k in (1, 2):
        cache.insert((0, k), object(), 1, 4)
        cache.pin((0, k))
    assert not cache.insert((0, 3), object(), 1, 4)  # everything pinned: refused, not over budget
    assert cache.used_bytes == 2 and cache.refused == 1
    cache.unpin((0, 1))
    assert cache.insert((0, 3), object(), 1, 4) and (0, 1) not in cache


def test_a_shrunk_cache_answers_for_its_new_capacity():
    """shrink (staged prefill takes its room from the cache) evicts down to the new capacity, and what holds_all
    says, which the scheduler's all_at_hand is decided from, follows: 4 experts fitted, 2 now do."""
    cache = ExpertCache({0: 4}, lambda part, cap: LRU(), entry_bytes=1, partition_of=lambda key: 0)
    every = [(0, k) for k in range(4)]
    for key in every:
        cache.insert(key, object(), 1, 4)
    assert cache.holds_all(every) and cache.resized == 0
    assert cache.shrink(2)
    assert cache.used_bytes == 2 and len(cache.entries) == 2 and cache.resized == 1
    assert not cache.holds_all(every) and cache.holds_all(every[:2])


def test_the_scheduler_stops_counting_on_every_expert_once_its_cache_shrinks(tmp_path):
    """An engine whose budget holds the model computes each layer's shared expert with its routed experts, as
    nothing is ever read mid-token; once its cache gives room to staged prefill, experts are read again and the
    scheduler says so."""
    from fate_edge.runtime.engine import Engine

    with Engine.load(None, max_batch=1) as engine:
        scheduler, cache = engine.scheduler, engine.cache
        assert scheduler.all_at_hand  # the default budget holds the bundled model
        assert cache.shrink(cache.capacity_bytes // 2)
        assert not scheduler.all_at_hand


@settings(max_examples=200, deadline=None)
@given(
    capacity=st.integers(min_value=0, max_value=40),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["insert", "pin", "unpin", "access"]),
            st.integers(0, 3),
            st.integers(0, 7),
            st.integers(1, 12),
        ),
        max_size=120,
    ),
    policy=st.sampled_from(["lru", "lfu", "arc", "popularity", "lcu"]),
)
def test_budget_is_never_exceeded(capacity, ops, policy):
    from fate_edge.runtime.cache import make_eviction

    parts = {layer: capacity // 4 for layer in range(4)}
    cache = ExpertCache(parts, lambda part, cap: make_eviction(policy, cap), entry_bytes=3)
    for op, layer, e, size in ops:
        key = (layer, e)
        if op == "insert":
            cache.insert(key, object(), size, 4)
        elif op == "pin":
            cache.pin(key)
        elif op == "unpin":
            cache.unpin(key)
        else:
            cache.access(key, key in cache, AccessInfo(layer_now=layer, num_layers=4))
        for p, cap in parts.items():
            assert cache.used[p] <= cap
        assert cache.used_bytes == sum(en.nbytes for en in cache.entries.values()) <= capacity


def test_shallow_favoring_matches_fate_rule():
    layers = list(range(8))
    assert shallow_favoring(40, layers, 16) == {0: 16, 1: 16, 2: 8, 3: 0, 4: 0, 5: 0, 6: 0, 7: 0}
    # C >= 4E: first four layers whole, the rest split evenly.
    assert shallow_favoring(64 + 4 * 5 + 3, layers, 16) == {0: 16, 1: 16, 2: 16, 3: 16, 4: 5, 5: 5, 6: 5, 7: 5}


def test_uniform_and_cost_aware_split():
    assert uniform(10, [0, 1, 2], 16) == {0: 4, 1: 3, 2: 3}
    curves = {0: [1.0, 0.1, 0.05, 0.0], 1: [1.0, 0.9, 0.8, 0.7]}
    # Layer 0 gains 0.9 from its first slot but only 0.05 from its second; layer 1 gains 0.1 per slot.
    assert cost_aware(1, [0, 1], 3, curves) == {0: 1, 1: 0}
    assert cost_aware(3, [0, 1], 3, curves) == {0: 1, 1: 2}
    assert cost_aware(2, [0, 1], 3, curves, miss_cost={0: 0.01, 1: 1.0}) == {0: 0, 1: 2}


@pytest.mark.parametrize("name", ["lru", "lfu", "arc", "popularity", "lcu"])
def test_policies_take_victims_only_from_candidates(name):
    from fate_edge.runtime.cache import make_eviction

    pol = make_eviction(name, 4)
    for k in range(6):
        pol.on_access((0, k), False, AccessInfo())
        pol.on_insert((0, k))
    assert pol.victim([(0, 2), (0, 4)]) in {(0, 2), (0, 4)}


def test_cost_aware_split_from_calibration_popularity():
    from fate_edge.runtime.cache.factory import build_cache, layer_slots, miss_curves
    from fate_edge.runtime.policy import PRESETS

    popularity = {0: [100, 0, 0, 0], 1: [25, 25, 25, 25]}  # layer 0 is served by one expert, layer 1 needs all
    assert miss_curves(popularity)[0] == [1.0, 0.0, 0.0, 0.0, 0.0]
    pol = PRESETS["lru"].with_(allocation="cost-aware")
    assert layer_slots(pol, 4, [0, 1], 4, popularity) == {0: 1, 1: 3}
    assert layer_slots(pol, 4, [0, 1], 4, None) == {0: 2, 1: 2}  # no calibration: uniform
    seeded = build_cache(PRESETS["lru"].with_(eviction="popularity"), 10, 1, [0, 1], 4, popularity=popularity)
    assert seeded.policies[0].score[(0, 0)] == 50.0 and seeded.policies[1].score[(1, 3)] == 50.0
