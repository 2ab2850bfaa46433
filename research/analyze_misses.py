"""Where the device preset's misses come from, and what a causal cache can save (issue 14: the oracle gap).

Records the decode routing of several prompts (the bundled inflated model by default, every expert cached so
the routing is the model's own), then, per budget:

1. counts, no timing: each eviction over one pool filled at load with the calibration's most used experts, prompt
   reads kept out of it (the device preset's cache): decode misses, of which cold (first use, not preloaded), and
   Belady-MIN's from the same start: its misses less the cold ones are capacity misses no causal policy can
   avoid; a policy's misses over Belady's are what a better causal policy could still save;
2. the simulator on a device's timeline (research/sweep_device_presets.py's costs and trace pickle, k pinned by
   --host-ms): device-equivalent tok/s of the device preset with each eviction, Belady without prefetch, and the
   oracle preset, and oracle / this.

    python research/analyze_misses.py --costs /tmp/emul_trace128.pkl --host-ms 29.7 --device orin-nano
"""

from __future__ import annotations

import argparse
import importlib
import json
import pickle
import statistics
import sys
from pathlib import Path

import torch

from fate_edge.format.popularity import store_popularity
from fate_edge.format.store import ExpertStore
from fate_edge.planning.device_presets import for_device
from fate_edge.planning.emulation import calibrate
from fate_edge.planning.plan_trace import PlanTrace
from fate_edge.planning.simulate import scale_costs
from fate_edge.runtime.budget import plan_budget
from fate_edge.runtime.cache import AccessInfo, ExpertCache
from fate_edge.runtime.cache.factory import build_cache
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge.runtime.generate import GenerateConfig
from fate_edge.runtime.policy import PRESETS
from fate_edge.runtime.preload import global_choice
from fate_edge.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep_device_presets import bench_store, sim  # noqa: E402

MODULES = ("json.decoder", "argparse", "textwrap", "csv", "heapq", "string")  # prompt sources: stdlib, offline
EVICTIONS = ("lru", "lfu", "lcu", "arc", "popularity", "next-use")


def record(store_dir: str, prompt_tokens: int, decode_tokens: int) -> dict[str, list]:
    """Per prompt, the recorded calls (the prompt's one per MoE layer, then the decode's)."""
    tok = Tokenizer(store_dir)
    st = ExpertStore(store_dir)
    total = st.expert_bytes(4) * len(st.index["moe_layers"]) * st.index["num_experts"]
    out = {}
    with Engine(EngineConfig(store_dir, 2 * total, "lru")) as eng:
        for name in MODULES:
            text = Path(importlib.import_module(name).__file__).read_text(encoding="utf-8")
            trace = eng.record_trace(
                tok.encode(text)[:prompt_tokens], GenerateConfig(max_tokens=decode_tokens + 1, ignore_eos=True)
            )
            out[name] = trace.calls
    return out


def replay(calls: list, cache: ExpertCache, layers: list[int], num_layers: int, preload: dict) -> tuple[int, int]:
    """Decode misses and cold misses of ``cache`` over ``calls``: filled with ``preload`` first, prompt reads only
    into free room (``keep_preloaded``), then every decode miss admitted."""
    for layer, experts in preload.items():
        for e in experts:
            cache.insert((layer, e), None, 1, 4)
    seen, misses, cold = set(cache.entries), 0, 0
    for i, (layer, experts) in enumerate(calls):
        info, decode, pinned = AccessInfo(layer_now=layer, num_layers=num_layers), i >= len(layers), []
        for e in experts:
            key = (layer, e)
            hit = key in cache
            cache.access(key, hit, info)
            if not hit and decode:
                misses += 1
                cold += key not in seen
            if hit or ((decode or cache.has_room(key, 1)) and cache.insert(key, None, 1, 4)):
                cache.pin(key)
                pinned.append(key)
            seen.add(key)
        for key in pinned:
            cache.unpin(key)
    return misses, cold


def counts(traces: dict, st: ExpertStore, fraction: float) -> dict:
    layers, e = list(st.index["moe_layers"]), st.index["num_experts"]
    pop = store_popularity(st.path)
    dev = for_device(PRESETS["fate-edge"], "orin-nano")
    entry = st.expert_bytes(4)
    slots = (
        plan_budget(int(fraction * entry * len(layers) * e), dev, entry, st.precisions[4].slot_bytes).cache_bytes
        // entry
    )
    start = global_choice(slots, layers, e, pop)
    top_k = len(next(iter(traces.values()))[len(layers)][1])  # a decode call's experts
    out: dict = {"slots": slots}
    for name in (*EVICTIONS, "belady"):
        total = cold = 0
        for calls in traces.values():
            cache = build_cache(dev.with_(eviction=name), slots, 1, layers, e, calls, pop, top_k=top_k)
            m, c = replay(calls, cache, layers, len(layers), start)
            total, cold = total + m, cold + c
        out[name] = total
        if name == "belady":
            out["cold"] = cold
    return out


def as_plan_trace(calls: list, layers: list[int], num_experts: int) -> PlanTrace:
    decode = calls[len(layers) :]
    ids = {layer: torch.tensor([ex for lyr, ex in decode if lyr == layer]) for layer in layers}
    return PlanTrace(ids, {}, num_experts, len(layers), {layer: ex for layer, ex in calls[: len(layers)]})


def simulated(traces: dict, st: ExpertStore, fraction: float, device: str, costs, host_ms: float) -> dict:
    layers, e = list(st.index["moe_layers"]), st.index["num_experts"]
    em = calibrate(device, str(st.path), [0], host_s_per_token=host_ms / 1e3)
    dev_costs = scale_costs(costs, 1 / em.k)
    dev_costs.layer_compute_s = em.device_s_per_token / len(layers)
    dev = for_device(PRESETS["fate-edge"], device)
    pols = {f"device preset, {name}": dev.with_(eviction=name) for name in ("lcu", "next-use")}
    pols.update({"belady, no prefetch": dev.with_(eviction="belady"), "oracle": PRESETS["oracle"]})
    budget = int(fraction * st.expert_bytes(4) * len(layers) * e)
    out = {}
    for label, p in pols.items():
        tps = [
            sim(as_plan_trace(calls, layers, e), p, budget, st, em.link, dev_costs).tokens_per_s
            for calls in traces.values()
        ]
        out[label] = statistics.mean(tps)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default=None, help="expert store (default: the bench's inflated bundled model)")
    ap.add_argument("--traces", default=None, help="pickle of recorded calls per prompt: reused, else written")
    ap.add_argument(
        "--costs",
        default=None,
        help="sweep_device_presets.py's (costs, trace) pickle: adds the simulated device-equivalent tok/s",
    )
    ap.add_argument("--device", default="orin-nano")
    ap.add_argument("--host-ms", type=float, default=29.7)
    ap.add_argument("--budgets", nargs="+", type=float, default=[0.2, 0.35, 0.5])
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    st = bench_store(args.store)
    args.store = str(st.path)
    if args.traces and Path(args.traces).exists():
        traces = pickle.loads(Path(args.traces).read_bytes())
    else:
        traces = record(args.store, args.prompt_tokens, args.decode_tokens)
        if args.traces:
            Path(args.traces).write_bytes(pickle.dumps(traces))
    costs = pickle.loads(Path(args.costs).read_bytes())[0] if args.costs else None
    report = {}
    for f in args.budgets:
        row = report[str(f)] = {"counts": counts(traces, st, f)}
        c = row["counts"]
        print(
            f"{f:.0%} ({c['slots']} slots), decode misses over {len(traces)} prompts: "
            + ", ".join(f"{k} {c[k]}" for k in (*EVICTIONS, "belady", "cold"))
            + f"; capacity (Belady - cold) {c['belady'] - c['cold']}; lcu / belady {c['lcu'] / c['belady']:.2f}, "
            f"next-use / belady {c['next-use'] / c['belady']:.2f}",
            flush=True,
        )
        if costs is not None:
            s = row["simulated"] = simulated(traces, st, f, args.device, costs, args.host_ms)
            best = max(s["oracle"], s["belady, no prefetch"])
            print(
                f"  simulated {args.device} device-eq. tok/s: "
                + ", ".join(
                    f"{k} {v:.0f} (oracle/this {s['oracle'] / v:.2f}x, best bound/this {best / v:.2f}x)"
                    for k, v in s.items()
                ),
                flush=True,
            )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
