"""fate-edge per device (issue 14 item 5): the preset resolves from the device, and on a recorded trace at that
device's timeline (its roofline compute, its own link) the simulator prefers it to the host preset; the oracle
still bounds it; a global cache filled at load holds the calibration's most used experts. Counts and simulated
seconds only; nothing is timed."""

import pytest
import torch
from _replay import PROMPT, decode_routing, record_with_predictions

from fate_edge import GenerateConfig
from fate_edge.apps.engine_args import policy_for_device
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.planning.device_costs import DEVICES
from fate_edge.planning.device_presets import DEVICE_PRESETS, HIDING_READ_LAYERS, for_device, for_device_and_store
from fate_edge.planning.emulation import calibrate, store_side
from fate_edge.planning.simulate import HostCosts, simulate
from fate_edge.runtime.budget import plan_budget
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge.runtime.policy import PRESETS
from fate_edge.runtime.preload import global_choice

# A global cache learns which experts are used most across layers: its edge shows over a decode longer than the
# 16 tokens of the other replay tests (at 16 tokens the two caches are level).
LONG = GenerateConfig(max_tokens=96, ignore_eos=True)


def test_fate_edge_resolves_per_device_by_short_or_profile_name():
    host = PRESETS["fate-edge"]
    for short, (profile, _) in DEVICES.items():
        assert profile in DEVICE_PRESETS
        for name in (short, profile):
            p = for_device(host, name)
            assert (p.allocation, p.eviction, p.predictor, p.preload, p.keep_preloaded) == (
                "global",
                "next-use",
                None,
                True,
                True,
            ), name
            assert p.name == "fate-edge"
    assert for_device(host, None) is host and for_device(host, "no-such-device") is host
    for name, preset in PRESETS.items():  # only fate-edge is re-derived per device
        if name != "fate-edge":
            assert for_device(preset, "orin-nano") is preset
    assert policy_for_device("fate-edge", "agx-orin").allocation == "global"
    assert policy_for_device("lru", "agx-orin") is PRESETS["lru"]


@pytest.mark.parametrize(
    "read_layers, row, width",
    [
        (0.5, "hiding", 5),
        (1.0, "hiding", 5),
        (1.15, "hiding", 4),
        (2.0, "hiding", 4),
        (3.47, "hiding", 3),
        (4.0, "hiding", 3),
        (4.01, "bound", None),
        (20.0, "bound", None),
        (None, "bound", None),
    ],
)
def test_the_row_follows_what_a_read_costs_in_layers_of_the_devices_compute(read_layers, row, width):
    """The cheaper a read next to the device's compute, the wider the prefetching row reads ahead; past
    HIDING_READ_LAYERS the link-bound row, which does not prefetch."""
    p = for_device(PRESETS["fate-edge"], "orin-nano", read_layers)
    got = (p.allocation, p.eviction, p.predictor, p.prefetch_gate, p.preload, p.keep_preloaded)
    want = {
        "hiding": ("uniform", "next-use", "cross-layer-norm", False, True, False),
        "bound": ("global", "next-use", None, False, True, True),
    }[row]
    assert got == want
    if row == "hiding":
        assert (p.lookahead, p.prefetch_width, p.max_prefetch_width) == (2, width, width)
    assert for_device(PRESETS["lru"], "orin-nano", read_layers) is PRESETS["lru"]


def test_a_stores_read_cost_picks_its_row_per_device(recorded):
    """The bundled model's int4 expert (small next to its resident weights) over each device's link, in MoE layers
    of that device's roofline token: cheap over the laptop's PCIe, dear over a Jetson's NVMe."""
    from fate_edge.format.store import ExpertStore
    from fate_edge.planning.device_costs import read_layers
    from fate_edge_lab.bench.worker import spec_policy

    store, side = recorded[0], recorded[5]
    entry, layers = ExpertStore(store).expert_bytes(4), len(recorded[3].moe_layers)
    cost = {}
    for device in DEVICES:
        em = calibrate(device, store, [0], host_s_per_token=1.0, side=side)  # only the device side is used
        cost[device] = read_layers(store, device)
        assert cost[device] == pytest.approx(em.link.transfer_time(entry) / (em.device_s_per_token / layers))
    assert cost["rtx4060"] < HIDING_READ_LAYERS < cost["orin-nano"] < cost["agx-orin"]
    for device, c in cost.items():
        want = for_device(PRESETS["fate-edge"], device, c)
        assert for_device_and_store(PRESETS["fate-edge"], device, store) == want
        assert policy_for_device("fate-edge", device, store) == want
        assert spec_policy({"preset": "fate-edge", "emulate": device, "store": str(store)}) == want
    assert for_device_and_store(PRESETS["fate-edge"], "rtx4060", store).predictor == "cross-layer-norm"
    assert for_device_and_store(PRESETS["fate-edge"], "orin-nano", store).predictor is None
    assert for_device_and_store(PRESETS["lru"], "rtx4060", store) is PRESETS["lru"]


def test_the_prefetching_row_prefetches_in_the_engine_and_keeps_the_text(recorded):
    """Where reads are cheap the device row reads ahead with the norm-aware cross-layer gate: at 35% every MoE layer
    after the first serves some decode uses from prefetch, the cache was filled at load, and the tokens are lru's."""
    store, cfg, (entry, slot) = recorded[0], recorded[3], recorded[4]
    budget = int(0.35 * len(cfg.moe_layers) * cfg.num_experts * entry) + 3 * slot
    policy = for_device(PRESETS["fate-edge"], "rtx4060", read_layers=1.0)
    decode = GenerateConfig(max_tokens=24, ignore_eos=True)
    with Engine(EngineConfig(store, budget, "lru")) as ref:
        want = ref.generate_text(PROMPT, decode)[0]
    with Engine(EngineConfig(store, budget, policy)) as eng:
        assert eng.load_report.reads > 0
        steps = eng.stream(PROMPT, decode)
        parts = [next(steps).text]  # the prompt's prefill and the first token
        before = {layer: list(v) for layer, v in eng.scheduler.layer_uses.items()}  # [cached, prefetched, demand]
        parts += [step.text for step in steps]
        prefetched = {layer: v[1] - before.get(layer, [0, 0, 0])[1] for layer, v in eng.scheduler.layer_uses.items()}
    assert "".join(parts) == want
    assert all(prefetched.get(layer, 0) > 0 for layer in cfg.moe_layers[1:]), prefetched


def test_the_bench_runs_fate_edge_as_on_the_emulated_device():
    from fate_edge_lab.bench.worker import spec_policy

    assert spec_policy({"preset": "fate-edge", "emulate": "orin-nano"}).allocation == "global"
    assert spec_policy({"preset": "fate-edge"}) is PRESETS["fate-edge"]
    assert spec_policy({"preset": "lru", "emulate": "orin-nano"}) is PRESETS["lru"]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, bundled_dir):
    """The bundled store, its recorded decode routing and predictor scores, sizes, and its store-side figures."""
    store = convert(bundled_dir, tmp_path_factory.mktemp("dev") / "store", ConvertOptions.full(bits=4), progress=False)
    trace, preds, cfg, sizes, popularity = record_with_predictions(store, LONG)
    return store, trace, preds, cfg, sizes, store_side(store), popularity


def _on_device(recorded, device: str, fraction: float) -> dict:
    """fate-edge's host preset, its device preset and the oracle simulated on ``device``'s timeline: compute from
    the profile's roofline for this store's token, reads over the device's own link."""
    store, trace, preds, cfg, (entry, slot), side, popularity = recorded
    em = calibrate(device, store, [0], host_s_per_token=1.0, side=side)  # only the device side is used
    costs = HostCosts(em.device_s_per_token / len(cfg.moe_layers))
    ids, warm = decode_routing(trace, cfg.moe_layers)
    budget = int(fraction * len(cfg.moe_layers) * cfg.num_experts * entry) + 3 * slot
    out = {}
    for name, policy in (
        ("host", PRESETS["fate-edge"]),
        ("device", for_device(PRESETS["fate-edge"], device)),
        ("oracle", PRESETS["oracle"]),
    ):
        plan = plan_budget(budget, policy, entry, slot)
        scores = preds.get(policy.predictor) if policy.predictor else None
        out[name] = simulate(
            ids,
            scores,
            policy,
            plan.cache_bytes,
            entry,
            em.link,
            costs,
            cfg.num_experts,
            cfg.num_hidden_layers,
            warm=warm,
            max_inflight=plan.pool_buffers - 2,
            popularity=popularity,
        )  # as the engine seeds its cache policy
    out["read_layers"] = em.link.transfer_time(entry) / costs.layer_compute_s  # one read, in layers of compute
    return out


@pytest.mark.parametrize("device", ["orin-nano", "orin-nx", "agx-orin", "rpi5"])
def test_the_device_preset_beats_the_host_preset_at_the_devices_timeline(recorded, device):
    """At 20% and 50% the global cache misses less and finishes the recorded 95-token decode sooner than the
    per-layer cache with gated prefetch (at 35% on this model it misses 68 against 64: level). rtx4060 is left
    out: with this model's 45 KB experts a read over PCIe fits in a layer, so it is not link-bound here; with
    2 MB experts it is (device_presets.py)."""
    for fraction in (0.2, 0.5):
        run = _on_device(recorded, device, fraction)
        assert run["read_layers"] > 2  # link-bound: a read outlasts two layers of the device's compute
        host, dev = run["host"], run["device"]
        assert dev.misses < host.misses and dev.total_s < host.total_s, (fraction, dev, host)


@pytest.mark.parametrize("device", list(DEVICES))
def test_no_device_preset_beats_the_oracle(recorded, device):
    for fraction in (0.2, 0.35, 0.5):
        run = _on_device(recorded, device, fraction)
        best = run["oracle"]
        for name in ("host", "device"):
            r = run[name]
            assert r.hit_rate <= best.hit_rate and r.total_s >= best.total_s, (device, fraction, name)


def test_global_choice_takes_the_most_used_experts_across_layers():
    counts = {0: [5, 0, 9, 1], 1: [7, 7, 0, 2]}
    assert global_choice(3, [0, 1], 4, counts) == {0: [2], 1: [0, 1]}
    assert global_choice(4, [0, 1], 4, counts) == {0: [0, 2], 1: [0, 1]}  # 5 over 2: ties to the shallower layer
    assert global_choice(3, [0, 1], 4, None) == {0: [0, 1], 1: [0]}  # no counts: spread, lowest-numbered


def test_a_global_cache_is_filled_at_load_with_the_most_used_experts(bundled_dir, tmp_path):
    """Before, a global cache had no per-layer slots and preload filled nothing: every prompt started cold."""
    from fate_edge.format.popularity import load_popularity

    store = convert(bundled_dir, tmp_path / "store", ConvertOptions.full(bits=4), progress=False)
    policy = for_device(PRESETS["fate-edge"], "orin-nano")
    with Engine(EngineConfig(store, "1MB", policy)) as engine:
        report = engine.load_report
        capacity = engine.cache.capacity_bytes // engine.cache.entry_bytes
        cfg = engine.model.config
        path = engine.store.path / "predictors" / "popularity.json"
        popularity = load_popularity(path) if path.exists() else None
        assert 0 < report.reads == capacity
        assert report.experts == global_choice(capacity, cfg.moe_layers, cfg.num_experts, popularity)
        assert (
            sum(1 for layer in cfg.moe_layers for e in range(cfg.num_experts) if (layer, e) in engine.cache) == capacity
        )


def test_the_simulators_warm_start_keeps_what_the_engines_prefill_keeps():
    """A prompt routes more experts to a layer than its partition holds: the engine's prefill pins each expert it
    loads until the layer is computed, so the partition keeps the first ones loaded (the most used: the load
    order) and the rest are not cached. The simulator kept the last ones (each insert evicted the one before),
    so the first decode token's hits on the prompt's most used experts were counted as misses."""
    from fate_edge.devices.link import LinkSpec

    policy = PRESETS["lru"]
    ids = {0: torch.tensor([[3, 5]]), 1: torch.tensor([[0, 1]])}
    warm = {0: [3, 5, 7, 9], 1: [0, 1, 2, 6]}  # most used first, as the prefill loads them
    run = simulate(
        ids,
        None,
        policy,
        cache_bytes=4 * 100,
        expert_bytes=100,
        link=LinkSpec("l", 1e9, 0.0),
        costs=1e-3,
        num_experts=10,
        num_layers=2,
        warm=warm,
    )
    assert (run.hits, run.misses) == (4, 0)


def test_the_experts_filled_at_load_survive_the_prompt(bundled_dir, tmp_path):
    """With ``keep_preloaded`` prefill reads enter only free room: every expert the global cache was filled with at
    load is still cached after the prompt, and the prompt misses fewer. Before, the prompt's reads for shallow
    layers evicted deep layers' preloaded experts before their layers ran."""
    store = convert(bundled_dir, tmp_path / "store", ConvertOptions.full(bits=4), progress=False)
    policy = for_device(PRESETS["fate-edge"], "orin-nano")
    misses = {}
    for keep in (True, False):
        with Engine(EngineConfig(store, "1MB", policy.with_(keep_preloaded=keep))) as engine:
            loaded = [(layer, e) for layer, experts in engine.load_report.experts.items() for e in experts]
            engine.generate_text(PROMPT, GenerateConfig(max_tokens=1))
            misses[keep] = engine.prefill_stats.misses
            kept = sum(key in engine.cache for key in loaded)
            assert len(loaded) > 0
            if keep:
                assert kept == len(loaded)
            else:
                assert kept < len(loaded)
    assert misses[True] < misses[False]
