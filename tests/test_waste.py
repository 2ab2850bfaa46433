"""Tests that see waste, not only wrong answers: counters on recorded runs at a fixed budget.

Each contract here was checked against a hand-made mutation that keeps every answer right (experts summed
in arrival order, cached experts prefetched again, prefetch buffers no longer capped): counters, never timings.
"""

import pytest
import torch
from _replay import CFG, PROMPT, all_expert_bytes, int4_store, record, spy
from _tiny_moe import build_tiny_moe

from fate_edge import load_model
from fate_edge.fetch.fetch_engine import Priority
from fate_edge.model.experts import ExpertProvider
from fate_edge.runtime.budget import plan_budget
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge.runtime.policy import PRESETS


class Arrival(ExpertProvider):
    """In-memory experts arriving in a chosen order, as reads landing in any order would."""

    def __init__(self, inner, order):
        self.inner, self.order = inner, order

    def get(self, layer, expert):
        return self.inner.get(layer, expert)

    def stream(self, layer, expert_ids):
        for e in self.order(list(expert_ids)):
            yield e, self.get(layer, e)


@pytest.fixture(scope="module")
def top4_dir(tmp_path_factory):
    return build_tiny_moe(tmp_path_factory.mktemp("top4") / "model", seed=3, top_k=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_are_summed_in_a_fixed_order_whatever_their_arrival(top4_dir, dtype):
    """Top-4 routing: four terms per token round differently in another order, so arrival order would show."""
    base = load_model(top4_dir, dtype=dtype)
    assert base.config.num_experts_per_tok == 4
    ids = torch.tensor([[3, 141, 59, 26, 53, 58, 97, 93, 23, 84, 62, 64, 33, 83, 27, 95]])
    outs = []
    shuffle = torch.Generator().manual_seed(0)
    for order in (lambda e: e, lambda e: e[::-1], lambda e: [e[i] for i in torch.randperm(len(e), generator=shuffle)]):
        model = load_model(top4_dir, dtype=dtype, experts=Arrival(base.experts, order))
        outs.append(model(ids, model.new_cache()))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_sums_experts_in_a_fixed_order_whatever_their_arrival(top4_dir, dtype):
    """One-token steps take their own path (no index bookkeeping): it too must sum in expert-id order."""
    base = load_model(top4_dir, dtype=dtype)
    shuffle = torch.Generator().manual_seed(1)
    outs = []
    for order in (lambda e: e, lambda e: e[::-1], lambda e: [e[i] for i in torch.randperm(len(e), generator=shuffle)]):
        model = load_model(top4_dir, dtype=dtype, experts=Arrival(base.experts, order))
        cache = model.new_cache()
        model(torch.tensor([[3, 141, 59, 26]]), cache)
        outs.append(torch.cat([model(torch.tensor([[t]]), cache) for t in (53, 58, 97, 93, 23, 84)], dim=1))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_path_equals_the_general_path(top4_dir, dtype):
    """Decode's direct loop over a token's k experts sums them to the bits of the grouped (indexed) path."""
    from fate_edge.model.layer_step import moe_sum
    from fate_edge.model.routed_experts import routed_grouped, routed_one

    model = load_model(top4_dir, dtype=dtype)
    gen = torch.Generator().manual_seed(2)
    for layer in model.config.moe_layers:
        for _ in range(4):
            h = torch.randn(1, model.config.hidden_size, generator=gen).to(dtype)
            x = torch.randn(1, model.config.hidden_size, generator=gen).to(dtype)
            weights, idx = model.route(layer, h)
            one = routed_one(model, moe_sum(x.clone()), h, layer, weights, idx)
            grouped = routed_grouped(model, moe_sum(x.clone()), h, layer, weights, idx)
            assert one is not None and one.dtype == torch.float32 and torch.equal(one, grouped)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, bundled_dir):
    return record(int4_store(tmp_path_factory.mktemp("waste") / "tiny-int4", bundled_dir))


def test_perfect_prefetch_reads_each_expert_once_and_wastes_nothing(recorded, one_thread):
    """The oracle with room for every expert: bytes read = each used expert's blob exactly once (without its
    fill at load, which would read them all before the request)."""
    store, trace = recorded
    with Engine(
        EngineConfig(store, 4 * all_expert_bytes(store), PRESETS["oracle"].with_(preload=False), trace=trace)
    ) as engine:
        seen = spy(engine)
        engine.generate_text(PROMPT, CFG)
        s = engine.stats
        blob = engine.store.ref(0, 0, 4)
        used = set(trace.accesses())
        assert not seen.of_cached and not seen.of_inflight
        assert s.misses + s.prefetch_hits == len(used) and s.prefetch_hits > 0
        assert engine.fetch.stats.bytes_read == len(used) * blob.read_length
        assert s.demand_bytes + s.prefetch_bytes == len(used) * blob.length and s.wasted_bytes == 0


@pytest.mark.parametrize("policy", ["fate", "activation-path", "oracle-lookahead-2"])
def test_nothing_cached_or_in_flight_is_prefetched_again(recorded, one_thread, policy):
    """At 35% of the expert bytes: every read ahead is of an expert neither cached nor already being read."""
    store, trace = recorded
    pol = PRESETS["oracle"].with_(lookahead=2) if policy.startswith("oracle") else PRESETS[policy]
    with Engine(
        EngineConfig(store, int(0.35 * all_expert_bytes(store)), pol.with_(cold_bits=None), trace=trace)
    ) as engine:
        seen = spy(engine)
        engine.generate_text(PROMPT, CFG)
        s = engine.stats
        assert seen.prefetched  # it did read ahead
        assert seen.of_cached == [] and seen.of_inflight == []
        # Every byte read was used or counted as wasted (a read cancelled part way counts what it read).
        slot = engine.store.ref(0, 0, 4).read_length
        assert engine.fetch.stats.bytes_read == (s.misses + s.prefetch_hits) * slot + s.wasted_bytes


def test_prefetch_buffers_are_capped_at_what_the_policy_can_have_in_flight():
    """Read buffers beyond the two for demand reads: lookahead x widest prefetch, at most max_inflight; the
    rest of the budget caches."""
    budget, entry, slot = 50_000_000, 120_000, 40_960
    edge = plan_budget(budget, PRESETS["fate-edge"], entry, slot)  # lookahead 1 x max width 2
    assert edge.pool_buffers == 2 + 2 and edge.cache_bytes == budget - 4 * slot - entry
    fate = plan_budget(budget, PRESETS["fate"].with_(max_prefetch_width=3), entry, slot)
    assert fate.pool_buffers == 2 + 3
    wide = plan_budget(budget, PRESETS["activation-path"].with_(prefetch_width=6), entry, slot, max_inflight=8)
    assert wide.pool_buffers == 2 + 8  # lookahead 2 x 6 = 12, capped at max_inflight
    assert plan_budget(budget, PRESETS["lru"], entry, slot).pool_buffers == 2  # nothing predicted: no extras


def test_engine_uses_every_prefetch_buffer_it_plans(recorded, one_thread):
    """The oracle two layers ahead, two experts a layer, nothing cached: the engine plans exactly the read
    buffers it fills (two prefetched layers in flight), not more."""
    store, trace = recorded
    pol = PRESETS["oracle"].with_(lookahead=2, prefetch_width=2, cache=False)
    with Engine(EngineConfig(store, "16MB", pol, trace=trace)) as engine:
        sched, most = engine.scheduler, {"n": 0}
        submit = engine.fetch.submit

        def counting(ref, priority, **kw):
            if priority != Priority.DEMAND:  # this read ahead joins those already in flight
                most["n"] = max(most["n"], len(sched.prefetches) + 1)
            return submit(ref, priority, **kw)

        engine.fetch.submit = counting
        engine.generate_text(PROMPT, CFG)
    assert engine.plan.pool_buffers - 2 == pol.lookahead * pol.prefetch_width == sched.max_inflight
    assert most["n"] == sched.max_inflight  # in flight at once: as many as planned, never more
