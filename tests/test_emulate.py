"""Device-faithful emulation (issue 14): the roofline and dilation arithmetic against hand-computed values, the
token's bytes and FLOPs counted from the bundled model's shapes, the emulated link at the profile's bandwidth / k,
and `fate-edge bench --emulate` reporting raw and device-equivalent (raw x k) figures apart. No timing assertion:
the host time is given where a test needs k to be known."""

import argparse
import json

import pytest
from fate_edge.devices.emulate import (
    DEFAULT_EFFICIENCY,
    device_roofline,
    dilated_link,
    dilation,
    reads_direct,
)
from fate_edge.devices.link import LinkSpec
from fate_edge.devices.profile import DeviceProfile, load_profile

from fate_edge.errors import ProfileError
from fate_edge.planning.device_costs import DEVICES, decode_token_work
from fate_edge.planning.emulation import calibrate


@pytest.fixture(scope="module")
def store(bundled_dir):
    from fate_edge.format.converted_stores import ensure_store

    return ensure_store(bundled_dir, cold_bits=2, progress=False, baselines=True)


def test_roofline_is_the_slower_of_bytes_and_flops_at_the_stated_efficiency():
    agx = device_roofline(load_profile("jetson-agx-orin-64gb"))
    assert agx.bandwidth_bytes_per_s == 204.8e9 and agx.flops_per_s == 42.6e12 and agx.efficiency == 0.7
    assert agx.compute_unit == "GPU dense fp16 tensor cores"
    # 143.36 MB at 204.8 GB/s x 0.7 = 143.36 GB/s: 1 ms; 1 GFLOP at 42.6 x 0.7 TFLOP/s is far less: bandwidth-bound
    assert agx.time_s(143.36e6, 1e9) == pytest.approx(1e-3)
    # 29.82 TFLOP/s effective: 29.82 GFLOP take 1 ms and outweigh 1 MB: compute-bound
    assert agx.time_s(1e6, 42.6e12 * 0.7 * 1e-3) == pytest.approx(1e-3)
    pi = device_roofline(load_profile("raspberry-pi-5-8gb"))  # no GPU: the CPU's fp32 peak
    assert pi.flops_per_s == 153.6e9 and pi.bandwidth_bytes_per_s == pytest.approx(17.1e9)
    assert pi.compute_unit == "CPU fp32"
    rtx = device_roofline(load_profile("laptop-rtx4060-8gb"))  # discrete GPU: weights in its GDDR6
    assert rtx.bandwidth_bytes_per_s == 256e9 and rtx.flops_per_s == 29.1e12
    nano = device_roofline(load_profile("jetson-orin-nano-8gb"))
    assert nano.bandwidth_bytes_per_s == 68e9 and nano.flops_per_s == 10.24e12


def test_a_profile_without_an_efficiency_gets_the_sourced_default_and_a_bad_one_is_refused():
    assert load_profile("desktop-rtx4090").roofline_efficiency is None
    roof = device_roofline(load_profile("desktop-rtx4090"))
    assert roof.efficiency == DEFAULT_EFFICIENCY and "2306.00978" in roof.efficiency_source
    d = {
        "name": "x",
        "description": "x",
        "ram_bytes": 1,
        "memory_bandwidth_gbps": 1.0,
        "storage_read_gbps": 1.0,
        "storage_latency_us": 1.0,
        "cpu_cores": 1,
        "cpu_gflops_fp32": 1.0,
        "unified_memory": True,
        "roofline_efficiency": 1.5,
    }
    d["sources"] = {k: "s" for k in d if k not in ("name", "description", "unified_memory")}
    with pytest.raises(ProfileError, match="roofline_efficiency"):
        DeviceProfile.from_dict(d)
    with pytest.raises(ProfileError, match="roofline_efficiency"):  # a figure without a source is refused too
        DeviceProfile.from_dict(
            {
                **d,
                "roofline_efficiency": 0.5,
                "sources": {k: v for k, v in d["sources"].items() if k != "roofline_efficiency"},
            }
        )


def test_dilation_divides_the_bandwidth_and_multiplies_the_latency():
    assert dilation(50e-3, 2e-3) == pytest.approx(25.0)
    assert dilation(1e-3, 4e-3) == pytest.approx(0.25)  # a host faster than the device speeds the link up
    with pytest.raises(ValueError):
        dilation(0.0, 1e-3)
    spec = LinkSpec("nvme", 3e9, 80e-6)
    slow = dilated_link(spec, 25.0)
    assert slow.bandwidth_bytes_per_s == pytest.approx(120e6) and slow.latency_s == pytest.approx(2e-3)
    assert "x25" in slow.name
    assert slow.transfer_time(12_000_000) == pytest.approx(25 * spec.transfer_time(12_000_000))
    # O_DIRECT only where this disk reads an expert faster than the dilated link moves it
    assert reads_direct(slow, 12_000_000, 0.05) and not reads_direct(slow, 12_000_000, 0.2)
    assert not reads_direct(slow, 12_000_000, None)


def test_token_work_counts_the_bundled_models_weights(store):
    from fate_edge.format.store import ExpertStore
    from fate_edge.model.arch import load_config

    cfg = load_config(store)
    h, v, hd = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shared = 3 * h * cfg.shared_expert_intermediate_size + h  # gate/up/down + the shared-expert gate
    per_layer = (h * q + q) + 2 * (h * kv + kv) + q * h + 2 * h + cfg.num_experts * h + shared  # q/k/v bias
    params = cfg.num_hidden_layers * per_layer + h + v * h  # final norm, lm_head; the embedding table is not read
    assert params == 2_883_264  # by hand: 8 x 262,080 + 192 + 4096 x 192
    work = decode_token_work(store, bits=4)
    experts = 8 * 2  # 8 MoE layers x top-2
    assert work.bytes == 2 * params + experts * ExpertStore(store).expert_bytes(4)
    assert work.flops == 2 * (params + experts * 3 * h * cfg.moe_intermediate_size)


def test_token_work_reads_quantized_resident_linears_at_their_precision(store):
    """With resident_bits the device reads what the run holds: the linears the loader quantizes (q/k/v, o,
    shared expert gate/up/gate-scalar and down, lm_head) at int4 with an fp16 scale and zero per group, or int8
    with an fp16 scale per row; biases, norms and routers stay fp16. FLOPs do not change."""
    from fate_edge.format.store import ExpertStore
    from fate_edge.model.arch import load_config

    cfg = load_config(store)
    assert (cfg.hidden_size, cfg.shared_expert_intermediate_size, cfg.vocab_size) == (192, 256, 4096)
    # By hand, per layer: in 192 (group 64): q 192x192, k 96x192, v 96x192, o 192x192, shared gate and up
    # 256x192 each, shared-expert gate 1x192; in 256 (group 128): down 192x256. lm_head 4096x192 (group 64).
    g64 = 8 * (36864 + 18432 + 18432 + 36864 + 49152 + 49152 + 192) + 4096 * 192
    g128 = 8 * 192 * 256
    rows = 8 * (192 + 96 + 96 + 192 + 256 + 256 + 1 + 192) + 4096
    fp16 = 8 * (384 + 2 * 192 + 16 * 192) + 192  # biases, norms, router per layer; the final norm
    assert g64 + g128 + fp16 == 2_883_264  # every resident param, as the fp16 test counts them
    experts = 16 * ExpertStore(store).expert_bytes(4)
    fp = decode_token_work(store, bits=4)
    w4 = decode_token_work(store, bits=4, resident_bits=4)
    w8 = decode_token_work(store, bits=4, resident_bits=8)
    assert w4.bytes == pytest.approx(g64 * (0.5 + 4 / 64) + g128 * (0.5 + 4 / 128) + 2 * fp16 + experts)
    assert w8.bytes == pytest.approx(g64 + g128 + 2 * rows + 2 * fp16 + experts)
    assert w4.flops == w8.flops == fp.flops
    assert "int4 linears" in w4.what and "fp16" in fp.what
    with pytest.raises(ValueError, match="resident_bits"):
        decode_token_work(store, resident_bits=2)


@pytest.mark.parametrize("device", sorted(DEVICES))
def test_the_emulated_link_is_the_profiles_divided_by_k(store, bundled_tokenizer, device):
    em = calibrate(device, store, [1, 2, 3], host_s_per_token=0.05)
    profile = load_profile(DEVICES[device][0])
    device_s = em.roofline.time_s(em.work.bytes, em.work.flops)
    assert em.device_s_per_token == device_s and em.k == pytest.approx(0.05 / device_s)
    base = profile.host_link_gbps if device == "rtx4060" else profile.storage_read_gbps
    assert em.link.bandwidth_bytes_per_s == pytest.approx(base * 1e9)
    assert em.emulated.bandwidth_bytes_per_s == pytest.approx(base * 1e9 / em.k)
    assert em.emulated.latency_s == pytest.approx(em.link.latency_s * em.k)
    assert em.device_tps(2.0) == pytest.approx(2.0 * em.k)
    assert em.to_dict()["dilation_k"] == em.k


@pytest.mark.slow
def test_bench_emulate_reports_raw_and_device_equivalent_apart(store, tmp_path, one_thread):
    from fate_edge_lab.bench.config import BenchConfig
    from fate_edge_lab.bench.outputs import write_outputs
    from fate_edge_lab.bench.run import run_bench

    device_s = device_roofline(load_profile("jetson-agx-orin-64gb")).time_s(*_work(store))
    k = 4.0  # a given host time: k known, the dilated link fast enough for a short test
    cfg = BenchConfig(
        model=str(store),
        presets=["load-on-demand-int4", "lru"],
        budgets=[0.5],
        prompt_tokens=[16],
        decode_tokens=4,
        runs=1,
        threads=1,
        peers=False,
        planner=False,
        out_dir=str(tmp_path / "out"),
        plot_path=str(tmp_path / "out" / "b.png"),
        isolate=False,
        emulate="agx-orin",
        emulate_host_ms=k * device_s * 1e3,
    )
    result = run_bench(cfg)
    paths = write_outputs(result, cfg)
    saved = json.loads(paths["json"].read_text())
    em = saved["emulation"]
    assert em["dilation_k"] == pytest.approx(k) and em["profile"] == "jetson-agx-orin-64gb"
    assert saved["config"]["links"] == ["emulated-agx-orin"]
    link = saved["links"]["emulated-agx-orin"]
    assert link["check"]["spec_gbps"] == pytest.approx(3.0 / k) and link["dilation"] == pytest.approx(k)
    assert link["check"]["io"] == ("O_DIRECT" if em["direct_io"] else "buffered")
    assert len(saved["results"]) == 2
    for r in saved["results"]:
        assert "error" not in r, r.get("error")
        assert r["link"] == "emulated-agx-orin"
        dev = r["device_equivalent"]
        assert dev["dilation_k"] == pytest.approx(k)
        assert dev["decode_tps"] == pytest.approx(r["median"]["decode_tps"] * k)
        assert dev["prefill_tps"]["16"] == pytest.approx(r["median"]["prefill_tps"]["16"] * k)
        # Without O_DIRECT (the emulation picks it only where this disk beats the dilated link, which depends on
        # the host's speed at the time) every run reads through the page cache: its fetch engine says "buffered".
        assert r["direct_io"] == ("O_DIRECT" if em["direct_io"] else "buffered")
    md = paths["markdown"].read_text()
    assert "Raw host decode tokens/s" in md and "Device-equivalent decode tokens/s" in md
    assert "device-eq decode tok/s" in md and "Device-faithful emulation of jetson-agx-orin-64gb" in md


@pytest.mark.slow
def test_bench_resident_bits_reach_the_runs_and_the_devices_roofline(store, tmp_path, one_thread):
    """``fate-edge bench --emulate DEVICE --resident-bits 4``: every fate-edge run holds its resident linears in int4
    (fewer resident bytes than a run at the store's dtype), and the device's roofline reads them at int4."""
    from fate_edge.runtime.engine import Engine
    from fate_edge.runtime.engine_config import EngineConfig
    from fate_edge_lab.bench.cli import add_arguments, config_from_args
    from fate_edge_lab.bench.run import run_bench

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args(
        [
            "--model",
            str(store),
            "--presets",
            "lru",
            "--budgets",
            "0.5",
            "--prompt-tokens",
            "16",
            "--decode-tokens",
            "4",
            "--runs",
            "1",
            "--threads",
            "1",
            "--no-peers",
            "--no-planner",
            "--out-dir",
            str(tmp_path / "out"),
            "--emulate",
            "agx-orin",
            "--emulate-host-ms",
            "2",  # a small k (host / device time): the dilated link's reads, not the bits, set this test's time
            "--resident-bits",
            "4",
        ]
    )
    cfg = config_from_args(args)
    cfg.isolate = False
    assert cfg.resident_bits == 4
    result = run_bench(cfg)
    em = result["emulation"]
    assert em["token_bytes"] == decode_token_work(store, 4, 4).bytes < decode_token_work(store).bytes
    with Engine(EngineConfig(store, "8MB", "lru")) as plain:
        plain_bytes = sum(t.numel() * t.element_size() for t in plain.model.w.values())
    [r] = result["results"]
    assert "error" not in r, r.get("error")
    assert r["resident_bytes"] < plain_bytes


def _work(store):
    w = decode_token_work(store)
    return w.bytes, w.flops


def test_the_simulator_on_the_dilated_timeline_is_the_device_one_slowed_by_k():
    """Costs scaled by 1 / k against the device's link predict k x the tokens/s of the host's costs against the
    dilated link: the emulated run and the device differ only in their clock."""
    import torch

    from fate_edge.planning.simulate import HostCosts, scale_costs, simulate
    from fate_edge.runtime.policy import PRESETS

    g = torch.Generator().manual_seed(0)
    layers, experts, n = 4, 8, 24
    ids = {layer: torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(n)]) for layer in range(layers)}
    preds = {(src, dst): torch.rand(n, experts, generator=g) for src in range(layers) for dst in range(src + 1, layers)}
    host = HostCosts(layer_compute_s=0.02, predict_s=0.001, read_cpu_s=0.004, consume_s=0.003, contention=0.5)
    k, link = 8.0, LinkSpec("nvme", 3e9, 80e-6)
    device = scale_costs(host, 1 / k)
    assert device.layer_compute_s == pytest.approx(0.0025) and device.read_cpu_s == pytest.approx(0.0005)
    assert device.contention == host.contention
    for name in ("load-on-demand-int4", "lru", "fate-edge"):
        policy = PRESETS[name]
        p = preds if policy.predictor else None
        dev = simulate(ids, p, policy, 3 * 4_000_000, 4_000_000, link, device, experts, layers)
        emu = simulate(ids, p, policy, 3 * 4_000_000, 4_000_000, dilated_link(link, k), host, experts, layers)
        assert dev.tokens_per_s == pytest.approx(k * emu.tokens_per_s), name
        assert (dev.hits, dev.prefetch_hits, dev.misses) == (emu.hits, emu.prefetch_hits, emu.misses), name


def test_plan_emulated_scales_the_measured_costs_onto_each_devices_timeline(store, bundled_tokenizer, one_thread):
    from fate_edge.planning.emulation import plan_emulated

    ids = bundled_tokenizer.encode("def main():\n    return sorted(items, key=len)\n" * 4)[:24]
    said: list[str] = []
    plans = plan_emulated(store, 3_000_000, ["orin-nano", "rpi5"], ids, decode_tokens=8, progress=said.append)
    assert set(plans) == {"orin-nano", "rpi5"}
    # the first device's preset is probed too: compute as a function of stall, as `fate-edge plan` measures it
    assert any("tokens of the preset" in line for line in said), said
    host = {d: em.host_s_per_token for d, (em, _) in plans.items()}
    assert host["orin-nano"] == host["rpi5"]  # one measurement, two devices
    for em, plan in plans.values():
        assert em.k == pytest.approx(em.host_s_per_token / em.device_s_per_token)
        assert plan.link == em.link  # the device's own link, not dilated: the costs carry the scaling
        assert plan.costs.layer_compute_s * em.k * 8 == pytest.approx(em.host_s_per_token)  # 8 MoE layers
