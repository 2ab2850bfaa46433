import pytest
import torch
from fate_edge.devices.detect import reader_contention
from fate_edge.devices.link import LinkSpec

from fate_edge.apps.cli import main
from fate_edge.planning.plan_trace import PlanTrace
from fate_edge.planning.planner import plan
from fate_edge.planning.simulate import HostCosts, simulate
from fate_edge.runtime.policy import PRESETS

E, K, N, LAYERS = 8, 2, 50, [0, 1, 2, 3]
LINK = LinkSpec("test", bandwidth_bytes_per_s=1e6, latency_s=0.0)  # a 1000-byte expert takes 1 ms
LINK_FAST = LinkSpec("fast", bandwidth_bytes_per_s=2e9, latency_s=20e-6)


def _trace(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {layer: torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)]) for layer in LAYERS}


def test_load_on_demand_time_is_all_reads_plus_compute():
    ids = _trace()
    r = simulate(ids, None, PRESETS["load-on-demand-int4"], 0, 1000, LINK, 0.002, E, len(LAYERS))
    assert r.misses == N * len(LAYERS) * K and r.hits == r.prefetch_hits == 0
    assert abs(r.stall_s - r.misses * 1e-3) < 1e-9
    assert abs(r.total_s - (r.stall_s + N * len(LAYERS) * 0.002)) < 1e-9


def test_perfect_predictions_hide_the_link_when_compute_is_long_enough():
    ids = _trace()
    onehot = {}
    for a, b in zip(LAYERS, LAYERS[1:]):
        s = torch.zeros(N, E)
        s.scatter_(1, ids[b], 1.0)
        onehot[(a, b)] = s
    pol = PRESETS["lru"].with_(predictor="oracle", prefetch_width=K, lookahead=1, cache=True)
    # 2.4 ms per routed expert: a layer's 5 ms are 0.2 ms of attention and routing, then its two experts.
    r = simulate(ids, onehot, pol, 0, 1000, LINK, HostCosts(0.005, expert_s=0.0024), E, len(LAYERS))
    # Every layer is served by a timely prefetch, layer 0 read ahead by the previous token's last layer (the
    # oracle knows the next token: OraclePredictor.targets). Only the first token's layer 0 waits: for the reads
    # the prompt issued, one read's time less the 0.2 ms before the layer routes (the second read is promoted,
    # landing 1 ms after the routing, while the first expert computes).
    assert r.misses == 0 and r.prefetch_hits == N * len(LAYERS) * K and r.prompt_prefetches == K
    assert abs(r.stall_s - 0.8e-3) < 1e-9 and r.wasted_bytes == 0
    assert abs(r.total_s - (r.stall_s + N * len(LAYERS) * 0.005)) < 1e-9


def test_cache_hits_with_a_budget_that_holds_everything():
    ids = _trace()
    r = simulate(ids, None, PRESETS["lru"], 10**6, 1000, LINK, 0.001, E, len(LAYERS))
    assert r.misses <= len(LAYERS) * E  # each expert read at most once: nothing is ever evicted
    assert r.hit_rate > 0.8


def test_plan_never_worse_than_its_start():
    ids = _trace()
    preds = {}
    for a, b in zip(LAYERS, LAYERS[1:]):
        preds[(a, b)] = torch.rand(N, E, generator=torch.Generator().manual_seed(a))
    trace = PlanTrace(ids, {"cross-layer": preds, "cross-layer-norm": preds}, E, len(LAYERS))
    start = PRESETS["fate-edge"].with_(name="planned", cold_bits=None)
    p = plan(trace, budget=20_000, expert_bytes=1000, slot_bytes=4096, link=LINK, layer_compute_s=0.002)
    base = [c for c in p.candidates if c.policy == start][0].result.tokens_per_s
    assert p.predicted_tokens_per_s >= base and len(p.candidates) > 5
    assert "chosen policy" in p.describe()


def test_plan_command_on_a_device_profile(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FATE_EDGE_CACHE", str(tmp_path))
    assert main(["plan", "--device", "jetson-orin-nano-8gb", "--memory-budget", "2MB", "--tokens", "64"]) == 0
    out = capsys.readouterr().out
    assert "jetson-orin-nano-8gb storage" in out and "predicted" in out and "chosen policy" in out


@pytest.mark.slow
def test_engine_plan_auto_runs_the_planners_choice(tmp_path, bundled_dir):
    from fate_edge import Engine, GenerateConfig
    from fate_edge.format.convert import ConvertOptions, convert

    store = convert(bundled_dir, tmp_path / "s", ConvertOptions.full(bits=4, keep_bf16=False), progress=False)
    with Engine.load(store, "2MB", policy="auto", max_batch=1, threads=None) as e:
        # the search's pick, or a preset it did not beat by more than the planner's error (plan_presets.py)
        assert e.planned is not None and e.policy == e.planned.policy
        assert e.policy.name in ("planned", "fate-edge", "fate")
        text, last = e.generate_text("def f(x):", GenerateConfig(max_tokens=8, ignore_eos=True))
        assert last.generation_tokens == 8


def test_demand_reads_of_one_layer_pipeline_with_decoding():
    # Two misses per layer: read, then decode the first while the second reads, then decode the second.
    ids = _trace()
    costs = HostCosts(layer_compute_s=0.002, read_cpu_s=0.0002, consume_s=0.0004)
    r = simulate(ids, None, PRESETS["load-on-demand-int4"], 0, 1000, LINK, costs, E, len(LAYERS))
    per_layer = (1e-3 + 0.0004) + max(1e-3, 0.0004)
    assert abs(r.stall_s - N * len(LAYERS) * per_layer) < 1e-9
    # Reader CPU longer than the link: the read takes the CPU time instead.
    slow = HostCosts(layer_compute_s=0.002, read_cpu_s=0.003, consume_s=0.0)
    r2 = simulate(ids, None, PRESETS["load-on-demand-int4"], 0, 1000, LINK, slow, E, len(LAYERS))
    assert abs(r2.stall_s - N * len(LAYERS) * 2 * 0.003) < 1e-9


def test_prefetch_reads_cost_compute_time_only_under_contention():
    ids = _trace()
    preds = {(a, b): torch.rand(N, E, generator=torch.Generator().manual_seed(a)) for a, b in zip(LAYERS, LAYERS[1:])}
    pol = PRESETS["lru"].with_(predictor="cross-layer", prefetch_width=2, lookahead=1)
    idle = simulate(
        ids, preds, pol, 4000, 1000, LINK, HostCosts(0.002, read_cpu_s=0.0005, contention=0.0), E, len(LAYERS)
    )
    busy = simulate(
        ids, preds, pol, 4000, 1000, LINK, HostCosts(0.002, read_cpu_s=0.0005, contention=1.0), E, len(LAYERS)
    )
    issued = (busy.prefetch_bytes + busy.wasted_bytes) // 1000
    assert busy.prefetch_hits == idle.prefetch_hits and issued > 0
    # Every prefetch issued (used or wasted) took its reader's CPU time away from compute.
    assert busy.total_s - idle.total_s >= issued * 0.0005 - 1e-9


def test_warm_experts_fill_the_cache_before_decode():
    ids = _trace()
    warm = {layer: list(range(E)) for layer in LAYERS}
    cold = simulate(ids, None, PRESETS["lru"], 10**6, 1000, LINK, 0.001, E, len(LAYERS))
    warmed = simulate(ids, None, PRESETS["lru"], 10**6, 1000, LINK, 0.001, E, len(LAYERS), warm=warm)
    assert cold.misses > 0 and warmed.misses == 0 and warmed.hit_rate == 1.0


def test_cached_experts_compute_while_the_layers_reads_travel():
    """A layer with one cached and one missed expert: the read (1 ms) starts when the layer routes, and the cached
    expert's compute (0.4 ms) runs meanwhile: 0.6 ms of stall, where a layer with both missed waits the full read
    for the first and, for the second, what is left of its read after decoding and computing the first."""
    ids = {0: torch.tensor([[0, 1]])}
    costs = HostCosts(layer_compute_s=0.001, consume_s=0.0001, expert_s=0.0004)
    one = simulate(ids, None, PRESETS["lru"], 1000, 1000, LINK, costs, E, 1, warm={0: [0]})
    assert one.hits == 1 and one.misses == 1
    assert abs(one.stall_s - (0.0006 + 0.0001)) < 1e-9 and abs(one.total_s - (0.001 + one.stall_s)) < 1e-9
    two = simulate(ids, None, PRESETS["lru"], 0, 1000, LINK, costs, E, 1)
    assert two.misses == 2
    # read 1 lands at 1 ms, decoded and computed by 1.5 ms; read 2 lands at 2 ms: 0.5 ms more, then decoded.
    assert abs(two.stall_s - (0.001 + 0.0001 + 0.0005 + 0.0001)) < 1e-9


def test_reader_contention():
    assert reader_contention(torch_threads=2, workers=2, cores=2) == 1.0  # every core already computes
    assert reader_contention(torch_threads=2, workers=2, cores=4) == 0.0  # readers have idle cores
    assert reader_contention(torch_threads=3, workers=2, cores=4) == 0.5


def test_measured_costs_and_decode_trace_on_the_bundled_store(tmp_path, bundled_dir):
    from fate_edge.format.convert import ConvertOptions, convert
    from fate_edge.planning.host_costs import measure_host_costs

    store = convert(bundled_dir, tmp_path / "s", ConvertOptions.full(bits=4, keep_bf16=False), progress=False)
    costs, link, trace = measure_host_costs(store, 2_000_000, LINK_FAST, list(range(40, 72)), decode_tokens=12)
    assert costs.layer_compute_s > 0 and costs.read_cpu_s > 0 and costs.consume_s > 0 and costs.predict_s > 0
    assert link is LINK_FAST
    assert all(v.shape[0] == 12 for v in trace.expert_ids.values())  # one row per decoded token
    assert set(trace.warm) == set(trace.expert_ids) and "best-available" in trace.predictions


def _perfect(ids):
    out = {}
    for a, b in zip(LAYERS, LAYERS[1:]):
        s = torch.zeros(N, E)
        s.scatter_(1, ids[b], 1.0)
        out[(a, b)] = s + 0.01 * torch.rand(N, E, generator=torch.Generator().manual_seed(b))
    return out


def test_simulated_gate_prefetches_only_where_reads_pay():
    ids = _trace()
    pol = PRESETS["fate-edge"].with_(predictor="cross-layer", max_prefetch_width=2)
    cheap = HostCosts(0.005, predict_s=1e-5, read_cpu_s=1e-4, contention=1.0)
    dear = HostCosts(0.005, predict_s=1e-5, read_cpu_s=5e-3, contention=1.0)  # a read costs more than it hides
    paid = simulate(ids, _perfect(ids), pol, 4000, 1000, LINK, cheap, E, len(LAYERS))
    shut = simulate(ids, _perfect(ids), pol, 4000, 1000, LINK, dear, E, len(LAYERS))
    assert paid.prefetch_hits > N  # perfect predictions on a cheap host: prefetched after the evidence phase
    assert shut.prefetch_hits == 0 and shut.prefetch_bytes == 0 and shut.wasted_bytes == 0


def test_the_engine_leaves_auto_to_load(tmp_path, bundled_dir):
    """The planner sits above the runtime: the Engine's constructor refuses "auto" with a pointer to Engine.load,
    which asks the planner first."""
    from fate_edge.errors import FateEdgeError
    from fate_edge.format.convert import ConvertOptions, convert
    from fate_edge.runtime.engine import Engine as RuntimeEngine
    from fate_edge.runtime.engine_config import EngineConfig

    store = convert(bundled_dir, tmp_path / "s", ConvertOptions.full(bits=4, keep_bf16=False), progress=False)
    with pytest.raises(FateEdgeError, match=r"Engine\.load"):
        RuntimeEngine(EngineConfig(store, "2MB", "auto"))


def test_stalls_slow_the_compute_after_them_by_the_measured_drag():
    ids = _trace()
    costs = HostCosts(0.002)
    plain = simulate(ids, None, PRESETS["load-on-demand-int4"], 0, 1000, LINK, costs, E, len(LAYERS))
    dragged = simulate(
        ids, None, PRESETS["load-on-demand-int4"], 0, 1000, LINK, HostCosts(0.002, stall_drag=0.5), E, len(LAYERS)
    )
    assert dragged.stall_s == pytest.approx(plain.stall_s)  # the wait itself is unchanged...
    assert dragged.total_s == pytest.approx(plain.total_s + 0.5 * plain.stall_s)  # ...the compute after it is not


def test_stall_drag_is_the_line_through_two_probes():
    from fate_edge.planning.host_costs import stall_drag

    # compute 10 ms + 0.3 s per s of stall, seen at 20 ms and at 40 ms of stall per token
    per_token, drag = stall_drag([(0.040, 0.022), (0.020, 0.016)], fallback=0.5)
    assert drag == pytest.approx(0.3) and per_token == pytest.approx(0.010)
    # stalls too close to tell a slope, or compute falling with stall: the fallback and no drag
    assert stall_drag([(0.020, 0.016), (0.021, 0.030)], fallback=0.5) == (0.5, 0.0)
    assert stall_drag([(0.020, 0.016), (0.040, 0.012)], fallback=0.5) == (0.5, 0.0)
    # a steep line from two noisy probes is capped: compute without stall keeps half the smaller measured one
    per_token, drag = stall_drag([(0.020, 0.010), (0.030, 0.030)], fallback=0.5)
    assert per_token == pytest.approx(0.005) and drag == pytest.approx(0.25)


def test_engine_plans_on_the_sample_it_is_given(tmp_path, bundled_dir, monkeypatch):
    from fate_edge import Engine, Tokenizer
    from fate_edge.errors import FateEdgeError
    from fate_edge.format.convert import ConvertOptions, convert
    from fate_edge.planning import auto

    store = convert(bundled_dir, tmp_path / "s", ConvertOptions.full(bits=4, keep_bf16=False), progress=False)
    seen = []
    real = auto.auto_plan

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(auto, "auto_plan", spy)
    sample = "for name in sorted(os.listdir(root)):\n    print(name)\n"
    with Engine.load(store, "2MB", policy="auto", plan_sample=sample, max_batch=1, threads=None) as e:
        assert e.planned is not None
    ids = Tokenizer(store).encode(sample)
    assert seen[0]["token_ids"] == ids and seen[0]["prompt_tokens"] == len(ids)
    with pytest.raises(FateEdgeError, match="plan_sample is empty"):
        Engine.load(store, "2MB", policy="auto", plan_sample="", max_batch=1, threads=None)
