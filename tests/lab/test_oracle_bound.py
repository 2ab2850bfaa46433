"""The oracle is a bound (DESIGN: "nothing may beat it; if something does, the oracle is wrong").

On requests recorded from the bundled model and two tiny test models, at 20, 35 and 50% of the expert bytes:
no preset gets a higher hit rate, less stall or a shorter time per token than ``oracle`` in the simulator
(every preset with its own predictor's scores, the same host costs and link), and none gets a higher hit
rate than ``oracle`` in the engine on the same request at the same budget. Counts and simulated seconds
only; nothing is timed.
"""

import pytest
import torch
from _replay import CFG, PROMPT, decode_routing, oracle_scores, record_with_predictions
from _tiny_moe import build_tiny_moe
from fate_edge.devices.link import LinkSpec
from fate_edge.predictors.activation_path import ActivationPathPredictor

from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.planning.simulate import HostCosts, simulate
from fate_edge.runtime.budget import plan_budget
from fate_edge.runtime.cache import AccessInfo, Belady, ExpertCache
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge.runtime.policy import PRESETS
from fate_edge.runtime.prefetch_choice import plan_oracle_prefetches, ranked

FRACTIONS = (0.2, 0.35, 0.5)
MODELS = ("bundled", "tiny-top2", "tiny-top4")


def _budget(recorded, fraction: float) -> int:
    """Room for ``fraction`` of all experts (cached int4) on top of the least any preset needs (read buffers and
    the expert being computed, in bf16: load-on-demand's)."""
    cfg, (entry, _), minimum = recorded[3], recorded[4], recorded[5]
    return minimum + int(fraction * len(cfg.moe_layers) * cfg.num_experts * entry)


@pytest.fixture(scope="module", params=MODELS)
def recorded(request, tmp_path_factory, bundled_dir):
    """(store with int4 and bf16 experts, its recorded trace, each predictor's decode scores, sizes)."""
    root = tmp_path_factory.mktemp(request.param)
    top2 = request.param == "tiny-top2"
    src = (
        bundled_dir
        if request.param == "bundled"
        else build_tiny_moe(root / "model", seed=0 if top2 else 3, top_k=2 if top2 else 4, expert_dim=32)
    )
    store = convert(src, root / "store", ConvertOptions.full(bits=4), progress=False)
    trace, preds, cfg, sizes, popularity = record_with_predictions(store)
    preds["activation-path"] = _activation_path_scores(trace, cfg, PRESETS["activation-path"].lookahead, popularity)
    preds["oracle"] = oracle_scores(trace, cfg.moe_layers, PRESETS["oracle"].lookahead, cfg.num_experts)
    with Engine(EngineConfig(store, "64MB", "load-on-demand")) as bf16:
        minimum = bf16.plan.minimum
    return store, trace, preds, cfg, sizes, minimum


def _activation_path_scores(trace, cfg, lookahead, popularity):
    """What the activation-path predictor scores at each decode call, replayed as the scheduler runs it
    (observe the call, then predict): (source, target) → [N, E]."""
    predictor = ActivationPathPredictor(cfg.moe_layers, cfg.num_experts, lookahead=lookahead, popularity=popularity)
    rows: dict[tuple[int, int], list[torch.Tensor]] = {}
    for i, (layer, experts) in enumerate(trace.calls):
        predictor.observe(layer, experts)
        if i >= len(cfg.moe_layers):  # decode
            pred = predictor.predict(layer, torch.zeros(1, 1))
            for target in pred.layers:
                rows.setdefault((layer, target), []).append(pred.for_layer(target))
    return {key: torch.cat(v) for key, v in rows.items()}


def _simulate_all(recorded, fraction, link, costs):
    trace, preds, cfg, (entry, slot) = recorded[1:5]
    ids, warm = decode_routing(trace, cfg.moe_layers)
    budget = _budget(recorded, fraction)
    out = {}
    for name, policy in PRESETS.items():
        plan = plan_budget(budget, policy, entry, slot)
        scores = preds.get(policy.predictor) if policy.predictor else None
        out[name] = simulate(
            ids,
            scores,
            policy,
            plan.cache_bytes,
            entry,
            link,
            costs,
            cfg.num_experts,
            cfg.num_hidden_layers,
            warm=warm,
            max_inflight=plan.pool_buffers - 2,
        )
    return out


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("speed", ["link-bound", "compute-bound"])
def test_no_preset_beats_the_oracle_in_the_simulator(recorded, fraction, speed):
    entry = recorded[4][0]
    read_s = 1e-3 if speed == "link-bound" else 2.5e-4  # one expert read vs 1 ms of compute per layer
    link = LinkSpec("bound", bandwidth_bytes_per_s=entry / read_s, latency_s=0.0)
    costs = HostCosts(1e-3, predict_s=5e-5, read_cpu_s=1e-4, consume_s=5e-5, contention=1.0)
    runs = _simulate_all(recorded, fraction, link, costs)
    best = runs.pop("oracle")
    for name, r in [*runs.items(), ("oracle", best)]:
        # the per-layer breakdown adds up, over the trace's MoE layers only
        assert sum(r.layer_misses.values()) == r.misses and set(r.layer_misses) <= set(recorded[3].moe_layers), name
    for name, r in runs.items():
        assert r.hit_rate <= best.hit_rate, (name, r.hit_rate, best.hit_rate)
        assert r.stall_s >= best.stall_s, (name, r.stall_s, best.stall_s)
        assert r.total_s >= best.total_s, (name, r.tokens_per_s, best.tokens_per_s)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_no_preset_beats_the_oracle_in_the_engine(recorded, fraction, one_thread):
    store, trace = recorded[0], recorded[1]
    budget = _budget(recorded, fraction)
    rates = {}
    for name in PRESETS:
        with Engine(EngineConfig(store, budget, name, trace=trace if name == "oracle" else None)) as engine:
            engine.generate_text(PROMPT, CFG)
            s = engine.request_stats
            assert s.uses > 0
            rates[name] = (s.hits + s.prefetch_hits) / s.uses
    best = rates.pop("oracle")
    assert all(rate <= best for rate in rates.values()), (best, rates)


def test_belady_follows_a_call_whatever_order_its_experts_arrive_in():
    """Layer 0 then layer 1, twice; each call's experts accessed in reverse (cached ones first, reads as they
    land): the next uses stay those of the record, and the current call's unaccessed expert is needed now."""
    calls = [(0, [1, 2]), (1, [3, 4]), (0, [1, 5]), (1, [3, 6])]
    belady = Belady(calls)
    info = AccessInfo()
    belady.on_access((0, 2), False, info)
    assert belady.next_use((0, 1)) == 0  # still to come in this call
    belady.on_access((0, 1), False, info)
    assert [belady.next_use(k) for k in [(0, 1), (0, 2), (1, 3), (1, 4), (0, 5)]] == [2, float("inf"), 1, 1, 2]
    cache = ExpertCache({0: 2}, lambda part, cap: belady, entry_bytes=1, partition_of=lambda key: 0)
    for key in [(0, 1), (0, 2)]:
        cache.insert(key, object(), 1, 4)
    belady.on_access((1, 4), False, info)
    assert cache.insert((1, 4), object(), 1, 4) and (0, 1) in cache  # (0, 2) is never used again


def test_oracle_reads_ahead_every_true_expert_in_order_of_use():
    """A read ahead waits in its read buffer and enters the cache only when used (Belady then picks the victim, as
    for a demand miss), so a full cache refuses none: the call's experts, most used first, minus what is cached or
    in flight, up to the room."""
    scores = torch.zeros(2, 8)
    scores[0, [5, 6]] = 0.5
    scores[1, [5, 2]] = 0.5
    plan = plan_oracle_prefetches([(2, scores)], busy=lambda key: key == (2, 6), room=4)
    assert [(p.layer, p.expert) for p in plan] == [(2, 5), (2, 2)]
    assert len(plan_oracle_prefetches([(2, scores)], busy=lambda key: False, room=1)) == 1


def test_oracle_reads_the_next_tokens_first_layer_ahead():
    """Past the last MoE layer the recording knows the next token's routing: the bound reads it ahead (a resident
    first layer, fate's, beat an oracle that could not), in the engine's predictor and the simulator alike."""
    from fate_edge.predictors.oracle import OraclePredictor

    calls = [(0, [1, 2]), (3, [4, 5]), (0, [6, 7]), (3, [0, 1])]
    oracle = OraclePredictor(calls, [0, 3], lookahead=1, num_experts=8)
    assert oracle.targets(3) == (0,) and oracle.targets(0) == (3,)
    for layer, _ in calls[:2]:
        oracle.observe(layer)
    pred = oracle.predict(3, torch.zeros(1, 4))
    assert pred.layers == (0,) and ranked(pred.scores[0][0]) == [6, 7]
    ids = {0: torch.tensor([[1, 2], [6, 7]]), 3: torch.tensor([[4, 5], [0, 1]])}
    run = simulate(ids, None, PRESETS["oracle"], 0, 4096, LinkSpec("l", 1e9, 0.0), 1e-3, 8, 4, max_inflight=4)
    assert (0, 0, 6) in run.prefetched and (0, 0, 7) in run.prefetched  # at token 0's last layer, for token 1


def test_oracle_warm_start_is_the_first_used_experts_in_order():
    """Belady's best start for an empty cache: the request's first distinct experts, as many as fit."""
    from fate_edge.runtime.preload import first_used

    calls = [(0, [3, 1]), (1, [2, 3]), (0, [1, 4]), (1, [5])]
    assert first_used(calls, 3) == {0: [3, 1], 1: [2]}
    assert first_used(calls, 4) == {0: [3, 1], 1: [2, 3]}
    assert first_used(calls, 99) == {0: [3, 1, 4], 1: [2, 3, 5]}


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("speed", ["link-bound", "compute-bound"])
def test_no_preset_beats_the_best_clairvoyant_configuration(recorded, fraction, speed):
    """The bound as the best of the oracle's configurations (read-ahead widths 0-64, planning/oracle_bound.py):
    no preset, the per-device ones (next-use eviction) included, decodes faster in the simulator; and it is at
    least as fast as the oracle preset and as Belady's cache with no reads ahead."""
    from dataclasses import replace

    from fate_edge.planning.device_presets import for_device
    from fate_edge_lab.bounds.oracle_bound import oracle_bound

    trace, preds, cfg, (entry, slot) = recorded[1:5]
    ids, warm = decode_routing(trace, cfg.moe_layers)
    read_s = 1e-3 if speed == "link-bound" else 2.5e-4
    link = LinkSpec("bound", bandwidth_bytes_per_s=entry / read_s, latency_s=0.0)
    costs = HostCosts(1e-3, predict_s=5e-5, read_cpu_s=1e-4, consume_s=5e-5, contention=1.0)
    budget = _budget(recorded, fraction)
    width, bound = oracle_bound(
        ids, preds["oracle"], budget, entry, slot, link, costs, cfg.num_experts, cfg.num_hidden_layers, warm=warm
    )
    runs = _simulate_all(recorded, fraction, link, costs)
    belady = replace(PRESETS["oracle"], prefetch_width=0)
    plan = plan_budget(budget, belady, entry, slot)
    runs["belady, no reads ahead"] = simulate(
        ids,
        None,
        belady,
        plan.cache_bytes,
        entry,
        link,
        costs,
        cfg.num_experts,
        cfg.num_hidden_layers,
        warm=warm,
        max_inflight=0,
    )
    device = for_device(PRESETS["fate-edge"], "orin-nano")  # the five devices' preset (next-use, one pool)
    hiding = for_device(PRESETS["fate-edge"], "orin-nano", read_layers=1.0)  # where reads are cheap: prefetching
    for name, policy in {"fate-edge, link-bound device preset": device, "fate-edge, prefetching row": hiding}.items():
        plan = plan_budget(budget, policy, entry, slot)
        scores = preds.get(policy.predictor) if policy.predictor else None
        runs[name] = simulate(
            ids,
            scores,
            policy,
            plan.cache_bytes,
            entry,
            link,
            costs,
            cfg.num_experts,
            cfg.num_hidden_layers,
            warm=warm,
            max_inflight=max(plan.pool_buffers - 2, 0),
        )
    for name, r in runs.items():
        assert r.total_s >= bound.total_s * (1 - 1e-9), (name, width, r.tokens_per_s, bound.tokens_per_s)
