"""One prefetch decision: the scheduler and the planner's simulator choose the same experts to read ahead."""

import pytest
import torch
from _replay import CFG, PROMPT, all_expert_bytes, int4_store, record, simulate_engine, spy

from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge.runtime.policy import PRESETS, PolicyConfig
from fate_edge.runtime.prefetch_choice import choose, plan_prefetches, prefetch_width

WIDE = PolicyConfig("wide", predictor="oracle", prefetch_width=8)


def test_experts_scored_zero_are_never_read():
    scores = torch.tensor([[0.0, 0.5, 0.0, 0.25, 0.25, 0.0]])
    chosen = [e for e, _, _ in choose(WIDE, scores, k=2, width=8)]
    assert chosen[0] == 1 and sorted(chosen) == [1, 3, 4]


def test_plan_is_nearest_layer_first_then_score_and_skips_busy_experts():
    near = torch.tensor([[0.1, 0.6, 0.3, 0.0]])
    far = torch.tensor([[0.9, 0.0, 0.0, 0.1]])
    busy = {(5, 2)}
    plan = plan_prefetches(WIDE, [(5, near), (6, far)], k=2, width=8, busy=busy.__contains__)
    assert [(p.distance, p.layer, p.expert) for p in plan] == [(0, 5, 1), (0, 5, 0), (1, 6, 0), (1, 6, 3)]
    assert len(plan_prefetches(WIDE, [(5, near), (6, far)], 2, 8, busy.__contains__, room=3)) == 3


def test_width_rules():
    fate = PRESETS["fate"]
    assert prefetch_width(fate, k=2, layer_s=0.0, read_s=1e-3) == 2  # not measured yet: top-k
    assert prefetch_width(fate, k=2, layer_s=5e-3, read_s=1e-3) == 5  # five reads fit into one layer
    assert prefetch_width(fate.with_(max_prefetch_width=3), 2, 5e-3, 1e-3) == 3
    assert prefetch_width(PRESETS["oracle"], 2, 5e-3, 1e-3) == 64
    mass = fate.with_(prefetch_width="mass", prefetch_mass=0.7, max_prefetch_width=4)
    scores = torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.05]])
    assert [e for e, _, _ in choose(mass, scores, k=1, width=prefetch_width(mass, 1, 0, 0))] == [0, 1]


def test_prefill_prefetches_the_union_most_popular_first_with_a_cold_tail():
    scores = torch.tensor([[0.9, 0.8, 0.0, 0.1], [0.7, 0.0, 0.9, 0.1], [0.9, 0.1, 0.0, 0.8]])
    chosen = choose(PRESETS["fate"].with_(cold_tail_mass=0.34), scores, k=2, width=1, use_cold=True)
    assert [e for e, _, _ in chosen][0] == 0  # in every token's top-2
    assert {e for e, _, _ in chosen} == {0, 1, 2, 3}  # the union, whatever the width
    assert {e for e, _, cold in chosen if cold} == {1, 2}  # one assignment each: the tail


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, bundled_dir):
    return record(int4_store(tmp_path_factory.mktemp("choice") / "tiny-int4", bundled_dir))


@pytest.mark.parametrize("case", ["cache holds every expert", "no cache, two layers ahead", "a third cached"])
def test_engine_and_simulator_prefetch_the_same_experts(recorded, one_thread, case):
    """One recorded request, replayed through the engine (the oracle predictor over it) and the simulator:
    the same reads issued at the same decode steps for the same layers, and the same hits and misses."""
    store, trace = recorded
    oracle = PRESETS["oracle"].with_(preload=False)  # the simulator starts cold, as the engine then does
    if case == "cache holds every expert":  # what is cached is never read ahead again
        policy, budget = oracle, 4 * all_expert_bytes(store)
    elif case == "no cache, two layers ahead":  # what is in flight is never read twice
        policy, budget = oracle.with_(cache=False, lookahead=2), "16MB"
    else:  # Belady-MIN evicts, a read ahead entering the cache only when used
        policy, budget = oracle, int(0.35 * all_expert_bytes(store))
    with Engine(EngineConfig(store, budget, policy, trace=trace)) as engine:
        seen = spy(engine)
        engine.generate_text(PROMPT, CFG)
        decode = engine.stats.minus(engine.prefill_stats)
        sim = simulate_engine(engine, trace)
    assert seen.prefetched and seen.prefetched == sim.prefetched
    assert (decode.hits, decode.prefetch_hits, decode.misses) == (sim.hits, sim.prefetch_hits, sim.misses)
    # Perfect predictions: every read ahead was used (the oracle's first ones issued by the prompt's last layer).
    assert decode.prefetch_hits == len(sim.prefetched) + sim.prompt_prefetches


def test_a_ranked_rows_plan_is_plan_prefetches_choice():
    """plan_ranked (one decode row, one target, its experts already ranked) picks what plan_prefetches picks from
    the scores: the first ``width`` ranks, those not busy, at most ``room``."""
    from fate_edge.runtime.prefetch_choice import plan_ranked, ranked

    g = torch.Generator().manual_seed(3)
    policy = PRESETS["fate-edge"]
    for trial in range(50):
        scores = torch.softmax(torch.randn(1, 16, generator=g), -1)
        busy_set = {(5, int(e)) for e in torch.randperm(16, generator=g)[: trial % 6]}
        width, room = 1 + trial % 5, trial % 4

        def busy(key, busy_set=busy_set):
            return key in busy_set

        want = plan_prefetches(policy, [(5, scores)], 4, width, busy, room)
        assert plan_ranked(5, ranked(scores[0]), width, busy, room) == want
