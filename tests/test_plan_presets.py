"""The planner weighs the device's presets (issue 39): they are always simulated, and a searched policy replaces the
best of them only when predicted faster by more than the planner's own error. Also the simulator starts a preset
from what its engine holds at load (sim_load.py). Nothing is timed."""

import torch
from fate_edge.devices.link import LinkSpec

from fate_edge.planning.plan_presets import MIN_MARGIN, choose, preset_candidates
from fate_edge.planning.plan_trace import PlanTrace
from fate_edge.planning.planner import plan, probe_error
from fate_edge.planning.sim_load import sim_preload, sim_resident
from fate_edge.planning.simulate import HostCosts, simulate
from fate_edge.runtime.policy import PRESETS

E, K, N, LAYERS = 8, 2, 40, [0, 1, 2, 3]
LINK = LinkSpec("test", bandwidth_bytes_per_s=1e6, latency_s=0.0)  # a 1000-byte expert takes 1 ms


def _trace(seed: int = 0) -> PlanTrace:
    g = torch.Generator().manual_seed(seed)
    ids = {layer: torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)]) for layer in LAYERS}
    preds = {(a, b): torch.rand(N, E, generator=torch.Generator().manual_seed(a)) for a, b in zip(LAYERS, LAYERS[1:])}
    return PlanTrace(ids, {"cross-layer": preds, "cross-layer-norm": preds, "best-available": preds}, E, len(LAYERS))


def test_choose_keeps_the_best_preset_unless_beaten_by_more_than_the_margin():
    a, b = PRESETS["fate-edge"], PRESETS["fate"]
    searched = PRESETS["lru"].with_(name="planned")
    tps = {a: 100.0, b: 90.0, searched: 108.0}.__getitem__
    assert choose(searched, [a, b], tps, margin=0.10) == a  # 8% faster is within a 10% error
    assert choose(searched, [a, b], tps, margin=0.05) == searched
    assert choose(searched, [b, a], tps, margin=0.0) == searched  # the least margin is MIN_MARGIN (3%)
    assert choose(PRESETS["lru"], [a], {a: 100.0, PRESETS["lru"]: 100 * (1 + MIN_MARGIN)}.__getitem__, 0.0) == a
    assert choose(searched, [], tps, margin=0.5) == searched


def test_presets_are_the_device_row_and_fate():
    host = preset_candidates(None)
    assert host == [PRESETS["fate-edge"], PRESETS["fate"]]
    nano = preset_candidates("orin-nano")
    assert nano[0].name == "fate-edge" and nano[0].allocation == "global" and nano[0].eviction == "next-use"
    assert nano[1] == PRESETS["fate"]


def test_plan_simulates_the_presets_and_picks_one_within_its_error():
    """The presets are among the candidates with their own predictions; with a margin no search beats, the pick is
    the best preset itself (its fields and name), and with none, the search's best if it beats them."""
    trace = _trace()
    slow = PRESETS["load-on-demand-int4"]  # a preset any cache beats
    presets = [PRESETS["fate-edge"], slow]
    wide = plan(trace, 20_000, 1000, 4096, LINK, 0.002, presets=presets, margin=100.0)
    assert [c.policy for c in wide.presets] == presets
    best = max(wide.presets, key=lambda c: c.result.tokens_per_s)
    assert wide.policy == best.policy and wide.predicted_tokens_per_s == best.result.tokens_per_s
    assert wide.margin == 100.0 and "preset" in wide.describe()
    tight = plan(trace, 20_000, 1000, 4096, LINK, 0.002, presets=[slow], margin=0.0)
    assert tight.policy.name == "planned" and tight.predicted_tokens_per_s > 1.03 * tight.presets[0].result.tokens_per_s


def test_probe_error_compares_the_lru_simulation_with_the_probe():
    trace = _trace()
    costs = HostCosts(0.002)
    from fate_edge.planning.planner import simulate_policy

    sim = simulate_policy(trace, PRESETS["lru"], 20_000, 1000, 4096, LINK, costs).tokens_per_s
    assert probe_error(trace, 20_000, 1000, 4096, LINK, costs) == 0.0  # no probe measured
    trace.probe_tokens_per_s = sim / 1.25
    assert abs(probe_error(trace, 20_000, 1000, 4096, LINK, costs) - 0.25) < 1e-9


def test_preload_fill_is_simulated_and_kept_through_the_prompt():
    """One global pool of 8 entries filled at load with layer 0 and 1's experts 0-3 (the calibration's most used);
    the prompt's experts are 4-7. Kept through the prompt (keep_preloaded), decode routed to 0-3 never misses;
    with the prompt's reads evicting the fill, it does."""
    ids = {layer: torch.tensor([[0, 1], [2, 3]] * 5) for layer in (0, 1)}
    pop = {layer: [9, 9, 9, 9, 1, 1, 1, 1] for layer in (0, 1)}
    warm = {layer: [4, 5, 6, 7] for layer in (0, 1)}
    dev = PRESETS["fate-edge"].with_(allocation="global", eviction="lru", predictor=None, preload=True)
    fill = sim_preload(dev, [0, 1], E, 8000, 1000, pop, None)
    assert fill == {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}
    kept = simulate(
        ids,
        None,
        dev.with_(keep_preloaded=True),
        8000,
        1000,
        LINK,
        0.001,
        E,
        2,
        warm=warm,
        popularity=pop,
        preload=fill,
    )
    lost = simulate(ids, None, dev, 8000, 1000, LINK, 0.001, E, 2, warm=warm, popularity=pop, preload=fill)
    cold = simulate(ids, None, dev.with_(keep_preloaded=True), 8000, 1000, LINK, 0.001, E, 2, warm=warm)
    assert kept.misses == 0 and lost.misses > 0 and cold.misses > 0


def test_fates_resident_layer_is_simulated_whole():
    """Fate holds its first MoE layer whole at the highest precision that fits: every use of it hits."""
    ids = {
        layer: torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t))[:K] for t in range(N)])
        for layer in LAYERS
    }
    fate = PRESETS["fate"]
    resident = sim_resident(fate, LAYERS, E, 20_000, {4: 1000, 16: 2000})
    assert resident is not None and resident.layer == 0 and resident.bits == 16
    assert sim_resident(fate, LAYERS, E, 12_000, {4: 1000, 16: 2000}).bits == 4  # bf16 does not fit: int4
    fill = sim_preload(fate, LAYERS, E, 20_000, 1000, None, resident)
    r = simulate(
        ids,
        None,
        fate.with_(predictor=None),
        20_000,
        1000,
        LINK,
        0.001,
        E,
        len(LAYERS),
        resident=resident,
        preload=fill,
    )
    assert r.layer_misses.get(0, 0) == 0 and r.misses > 0


def test_a_recorded_requests_calls_become_a_plan_trace():
    """The engine's recorded calls (prompt: one call per layer with its experts by popularity; then one call per
    layer and token of top_k experts) split into the prompt's warm experts and the decode's routing."""
    from fate_edge.planning.plan_trace import trace_from_calls

    calls = [(0, [3, 1, 2]), (1, [0, 5, 4]), (0, [1, 2]), (1, [4, 0]), (0, [3, 2]), (1, [5, 4])]
    t = trace_from_calls(calls, [0, 1], top_k=2, num_experts=6, num_layers=2)
    assert t.warm == {0: [3, 1, 2], 1: [0, 5, 4]}
    assert t.expert_ids[0].tolist() == [[1, 2], [3, 2]] and t.expert_ids[1].tolist() == [[4, 0], [5, 4]]
    assert trace_from_calls(calls[:2], [0, 1], 2, 6, 2) is None  # a prompt only: nothing decoded


def test_predict_on_another_routing_uses_the_plans_costs():
    """The pick simulated over another request's routing with the plan's link and costs; a policy that needs
    predictor scores the routing does not carry has no prediction there."""
    from fate_edge.planning.planner import predict_on, simulate_policy

    trace, other = _trace(0), _trace(1)
    other.predictions = {}
    p = plan(trace, 20_000, 1000, 4096, LINK, HostCosts(0.002), presets=[PRESETS["lru"]], margin=100.0)
    assert p.policy == PRESETS["lru"]
    want = simulate_policy(other, PRESETS["lru"], 20_000, 1000, 4096, LINK, p.costs).tokens_per_s
    assert predict_on(p, other, 20_000, 1000, 4096) == want != p.predicted_tokens_per_s
    assert predict_on(p, other, 20_000, 1000, 4096, policy=PRESETS["fate-edge"]) is None
