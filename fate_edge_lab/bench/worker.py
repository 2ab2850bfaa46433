"""Worker side: one configuration's runs, or the routing traces, in the process ``python -m fate_edge_lab.bench``
starts for them (``--worker SPEC`` / ``--trace SPEC``); the spec and the result are JSON files."""

from __future__ import annotations

import dataclasses
import gc
import json
import pickle
import sys
import time
from pathlib import Path
from typing import Any

from fate_edge_lab.bench.prepare import drop_page_cache
from fate_edge_lab.bench.results import summarize_runs


def child_command(mode: str, spec_path: Path, llama_cpp: bool = False) -> list[str]:
    """The command running ``mode`` (worker, trace, peer) on ``spec_path`` in a fresh interpreter. The
    installed package is imported: no source checkout or PYTHONPATH is needed. ``llama_cpp``: the child runs
    llama.cpp, whose OpenMP runtime is set up first (fate_edge_lab.bench.llamacpp.llama_child)."""
    if llama_cpp:
        from fate_edge_lab.bench.llamacpp import llama_child

        code = f"import sys; from fate_edge_lab.bench.cli import main; sys.exit(main(['--{mode}', sys.argv[1]]))"
        return [sys.executable, "-c", llama_child(code), str(spec_path)]
    return [sys.executable, "-m", "fate_edge_lab.bench", f"--{mode}", str(spec_path)]


class LayerCounter:
    """Routing observer run before the scheduler's: was each routed expert cached, in flight, or a miss?"""

    def __init__(self, engine):
        self.engine = engine
        self.counts: dict[str, dict[int, list[int]]] = {"prefill": {}, "decode": {}}

    def __call__(self, layer, h, idx, weights) -> None:
        phase = "prefill" if h.shape[0] > 1 else "decode"
        c = self.counts[phase].setdefault(layer, [0, 0, 0])  # cached, prefetched (issued earlier), missed
        cache, pending = self.engine.cache, self.engine.scheduler.prefetches
        for e in idx.flatten().unique().tolist():
            key = (layer, e)
            if cache is not None and key in cache:
                c[0] += 1
            elif key in pending:
                c[1] += 1
            else:
                c[2] += 1


def _stats_dict(s) -> dict[str, Any]:
    d = dataclasses.asdict(s)
    d.update(uses=s.uses, hit_rate=s.hit_rate, exact_match=s.exact_match, recall=s.recall)
    return d


def _sum_stats(items):
    from fate_edge.runtime.scheduler import SchedulerStats

    total = SchedulerStats()
    for s in items:
        for f in dataclasses.fields(total):
            setattr(total, f.name, getattr(total, f.name) + getattr(s, f.name))
    return total


def spec_policy(spec: dict):
    """The configuration's policy: the planner's choice given as data, else the preset, ``fate-edge`` as it runs
    on the emulated device (device_presets.py) under ``--emulate``."""
    from fate_edge.planning.device_presets import for_device_and_store
    from fate_edge.runtime.policy import PolicyConfig, get_policy

    if spec.get("policy"):
        return PolicyConfig(**spec["policy"])
    return for_device_and_store(
        get_policy(spec["preset"]), spec.get("emulate"), spec.get("store"), spec.get("resident_bits")
    )


def one_request(spec: dict, ids: list[int], max_tokens: int, trace, counter_sink: dict) -> dict[str, Any]:
    from fate_edge.devices.link import LinkSpec, ThrottledLink

    from fate_edge.runtime.engine import Engine
    from fate_edge.runtime.engine_config import EngineConfig
    from fate_edge.runtime.generate import GenerateConfig

    link = ThrottledLink(LinkSpec(**spec["link_spec"])) if spec["link_spec"] else None
    dropped = None
    if spec["link"] == "raw-disk" and spec["drop_caches"]:
        dropped = drop_page_cache()
    policy = spec_policy(spec)
    # Emulated link: buffered reads from the warm page cache, throttled to the link (O_DIRECT would read at
    # this disk's speed first, slower than the NVMe and PCIe links), except under --emulate where the dilated
    # link is slower than this disk: then O_DIRECT, so a read costs the CPU what a DMA does (no memcpy).
    direct = spec.get("direct_io", link is None)
    engine = Engine(
        EngineConfig(
            spec["store"],
            spec["budget_bytes"],
            policy,
            link=link,
            trace=trace,
            workers=spec["fetch_workers"],
            device=spec.get("device", "cpu"),
            direct_io=direct,
            resident_bits=spec.get("resident_bits"),
        )
    )
    counter = LayerCounter(engine)
    counter_counts = counter.counts
    engine.model.observers.insert(0, counter)
    try:
        times, tokens, last = [], [], None
        for last in engine.stream(ids, GenerateConfig(max_tokens=max_tokens, ignore_eos=True)):
            times.append(time.perf_counter())
            tokens.append(last.token)
        assert last is not None
        decode = _sum_stats(engine.token_stats)
        n_dec = len(engine.token_stats)
        out = {
            "prompt_tokens": len(ids),
            "prefill_tps": last.prompt_tps,
            "prefill": _stats_dict(engine.prefill_stats),
            "decode_tokens": n_dec,
            "decode_tps": n_dec / (times[-1] - times[0]) if n_dec and times[-1] > times[0] else None,
            "decode": _stats_dict(decode),
            "tokens": tokens,
            "direct_io": engine.fetch.direct_io_note,
            "page_cache": None if dropped is None else {"dropped": dropped[0], "note": dropped[1]},
            "plan": {
                "cache_bytes": engine.plan.cache_bytes,
                "pool_bytes": engine.plan.pool_bytes,
                "entry_bytes": engine.plan.entry_bytes,
                "slots": {str(k): v for k, v in engine.plan.slots.items()},
            },
            "load": dataclasses.asdict(engine.load_report),  # reads at load, apart from prefill and decode
            "resident_bytes": sum(t.numel() * t.element_size() for t in engine.model.w.values()),
        }
    finally:
        engine.close()
        del engine, counter
        gc.collect()  # the next request's cold engine starts from this one's memory returned
    for phase, layers in counter_counts.items():
        if phase == "decode" and max_tokens < 2:
            continue
        dst = counter_sink.setdefault(phase, {})
        for layer, c in layers.items():
            acc = dst.setdefault(str(layer), [0, 0, 0])
            for i in range(3):
                acc[i] += c[i]
    return out


def verify_store(spec: dict) -> None:
    """Check the CRC of every blob at the precisions this configuration reads (see fetch.py: verify once)."""
    from fate_edge.format.store import ExpertStore

    policy = spec_policy(spec)
    store = ExpertStore(spec["store"])
    store.verify([b for b in (policy.bits, policy.cold_bits) if b in store.precisions])


def plan_in_worker(spec: dict, prompt: list[int], recorded=None) -> dict[str, Any]:
    """The planner's choice for this configuration's link and budget (see :func:`planner_configs`), planned for the
    request the bench measures: its probes decode ``prompt`` for ``spec["decode_tokens"]`` tokens, as a user plans
    with a sample of their own prompts (``fate-edge plan --corpus``). One request's speed depends on its text (the
    spread over texts: research/probe_text_spread.py), so a plan probed on other text predicts the mean
    request, not this one. ``recorded``: the measured request's routing (an engine Trace), over which the pick and
    the fate-edge preset are simulated too, with the planner's costs: the time model's prediction for this very
    request."""
    from fate_edge.devices.link import LinkSpec

    from fate_edge.format.store import ExpertStore
    from fate_edge.model.arch import load_config
    from fate_edge.planning.plan_trace import describe_store, trace_from_calls
    from fate_edge.planning.planner import auto_plan, predict_on

    t0 = time.perf_counter()
    link = LinkSpec(**spec["link_spec"]) if spec["link_spec"] else None
    p = auto_plan(
        spec["store"],
        spec["budget_bytes"],
        link=link,
        workers=spec["fetch_workers"],
        direct_io=spec.get("direct_io"),
        resident_bits=spec.get("resident_bits"),
        device=spec.get("emulate"),
        token_ids=prompt,
        prompt_tokens=len(prompt),
        decode_tokens=spec["decode_tokens"],
    )
    out = {
        "policy": dataclasses.asdict(p.policy),
        "planner_predicted_decode_tps": p.predicted_tokens_per_s,
        "planner_costs": p.costs.describe(),
        "planner_s": time.perf_counter() - t0,
        # the presets it weighed, predicted on the same trace (the bench sets them beside their measurements)
        "planner_preset_predictions": {c.policy.name: c.result.tokens_per_s for c in p.presets},
        "planner_margin": p.margin,
    }
    cfg, store = load_config(spec["store"]), ExpertStore(spec["store"])
    trace = (
        trace_from_calls(
            recorded.calls, cfg.moe_layers, cfg.num_experts_per_tok, cfg.num_experts, cfg.num_hidden_layers
        )
        if recorded is not None
        else None
    )
    if trace is not None:
        describe_store(trace, store)
        sizes = (spec["budget_bytes"], store.expert_bytes(p.policy.bits), store.precisions[p.policy.bits].slot_bytes)
        on_run = predict_on(p, trace, *sizes)
        preset = next((c.policy for c in p.presets if c.policy.name == "fate-edge"), None)
        if on_run is not None:
            out["planner_predicted_on_run_routing"] = on_run
        if preset is not None and predict_on(p, trace, *sizes, policy=preset) is not None:
            out["preset_predicted_on_run_routing"] = predict_on(p, trace, *sizes, policy=preset)
    return out


def worker_main(spec_path: str) -> int:
    """Run one configuration (``spec_path``: JSON written by the parent); write ``<spec>.result.json``."""
    import torch

    from fate_edge.process_memory import peak_rss_bytes
    from fate_edge_lab.bench.host import load_average

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    t0 = time.perf_counter()
    traces = {}
    if spec["trace_file"]:
        with open(spec["trace_file"], "rb") as f:
            traces = pickle.load(f)["traces"]
    prompts = {int(k): v for k, v in spec["prompts"].items()}
    decode_len = min(prompts)
    trace = traces.get(decode_len) if spec["preset"] == "oracle" else None
    planned = plan_in_worker(spec, prompts[decode_len], traces.get(decode_len)) if spec.get("run_planner") else {}
    if planned:
        spec["policy"] = planned["policy"]
    # Every configuration measures the steady state of a long-running engine, in which each blob's CRC
    # was checked on its first read and is not checked again: check them all here, before timing.
    verify_store(spec)
    # Warm-up (not measured): first-call costs of torch and of the engine's code paths.
    one_request(spec, prompts[decode_len][:2], 2, trace, {})
    runs: list[dict[str, Any]] = []
    layers: dict[str, Any] = {}
    for _ in range(spec["runs"]):
        run: dict[str, Any] = {"requests": {}}
        for n, ids in sorted(prompts.items()):
            max_tokens = spec["decode_tokens"] if n == decode_len else 1
            trace = traces.get(n) if spec["preset"] == "oracle" else None
            run["requests"][str(n)] = one_request(spec, ids, max_tokens, trace, layers)
        runs.append(run)
    first = runs[0]["requests"][str(decode_len)]
    result = {
        "preset": spec["preset"],
        "link": spec["link"],
        "budget_fraction": spec["budget_fraction"],
        "budget_bytes": spec["budget_bytes"],
        "threads": torch.get_num_threads(),
        "fetch_workers": spec["fetch_workers"],
        "runs": runs,
        "median": summarize_runs(runs, decode_len),
        "per_layer": layers,
        "tokens": first["tokens"],
        "plan": first["plan"],
        "direct_io": first["direct_io"],
        "resident_bytes": first["resident_bytes"],
        "page_cache": first["page_cache"],
        "peak_rss_bytes": peak_rss_bytes(),
        "wall_s": time.perf_counter() - t0,
        "load_average": load_average(),  # 1/5/15-minute, as the worker ended
        **planned,
    }
    first_tokens = {n: q["tokens"] for n, q in runs[0]["requests"].items()}
    for r in runs:  # keep the JSON small: one token list per configuration, a flag per run
        for n, q in r["requests"].items():
            q["tokens_equal_first_run"] = q.pop("tokens") == first_tokens[n]
    Path(spec_path + ".result.json").write_text(json.dumps(result))
    return 0


def trace_main(spec_path: str) -> int:
    """Record each request's routing trace (for the oracle) and its int4 reference tokens."""
    import torch

    from fate_edge.runtime.engine import Engine
    from fate_edge.runtime.engine_config import EngineConfig
    from fate_edge.runtime.generate import GenerateConfig

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    prompts = {int(k): v for k, v in spec["prompts"].items()}
    decode_len = min(prompts)
    traces, tokens = {}, {}
    big = int(spec["int4_total"] * 2 + 64e6)  # everything fits: the trace does not depend on the policy
    for n, ids in sorted(prompts.items()):
        engine = Engine(
            EngineConfig(
                spec["store"], big, "lru", workers=spec["fetch_workers"], resident_bits=spec.get("resident_bits")
            )
        )
        cfg = GenerateConfig(max_tokens=spec["decode_tokens"] if n == decode_len else 1, ignore_eos=True)
        try:
            traces[n] = engine.record_trace(ids, cfg)
            tokens[n] = [r.token for r in engine.stream(ids, cfg)]  # a second pass, all from the warm cache
        finally:
            engine.close()
    with open(spec["trace_file"], "wb") as f:
        pickle.dump({"traces": traces, "tokens": tokens}, f)
    return 0
