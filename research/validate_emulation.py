"""Validate device-faithful emulation (issue 14) on one store: the loading share of load-on-demand on the emulated
device (MoE-APEX measured 86-94% of a Mixtral layer's time on a Jetson AGX Orin), and the simulator's prediction
of the measured emulated tok/s (costs from the planner's probe, scaled by 1 / k onto the device's timeline).

    fate-edge synth --like mixtral-8x7b --layers 2 /tmp/mixtral-2l
    fate-edge convert /tmp/mixtral-2l /tmp/mixtral-2l-store
    python research/validate_emulation.py /tmp/mixtral-2l-store --device agx-orin --json out.json

Every policy runs in rounds (each round: every policy once, on a fresh engine), medians reported; the load
average is recorded beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from fate_edge_lab.bench.publish import add_results_arg, replace_between_markers, results_file


def run_policy(store: str, budget: int, policy: str, em, ids: list[int], tokens: int, workers: int) -> dict:
    """Decode ``tokens`` greedy tokens under the emulated link; per-token raw figures and the loading share."""
    from fate_edge.devices.link import ThrottledLink

    from fate_edge.planning.host_costs import token_compute_s
    from fate_edge.runtime.engine import Engine
    from fate_edge.runtime.engine_config import EngineConfig
    from fate_edge.runtime.generate import GenerateConfig

    eng = Engine(
        EngineConfig(store, budget, policy, link=ThrottledLink(em.emulated), workers=workers, direct_io=em.direct_io)
    )
    try:
        times = [time.perf_counter() for _ in eng.stream(ids, GenerateConfig(max_tokens=tokens + 1, ignore_eos=True))]
        st = eng.token_stats
        dts = np.diff(times)
        stall = float(np.median([s.stall_s for s in st]))
        consume = float(np.median([s.consume_s for s in st]))
        compute = float(np.median(token_compute_s(times, st)))
        total = float(np.median(dts))
        return {
            "decode_tps": len(dts) / float(np.sum(dts)),
            "ms_per_token": 1e3 * total,
            "stall_ms": 1e3 * stall,
            "blob_decode_ms": 1e3 * consume,
            "compute_ms": 1e3 * compute,
            "loading_share": stall / (stall + compute),
            "loading_share_with_blob_decode": (stall + consume) / (stall + consume + compute),
            "misses_per_token": sum(s.misses for s in st) / len(st),
            "hit_rate": sum(s.hits for s in st) / max(1, sum(s.uses for s in st)),
            "io": eng.fetch.direct_io_note,
        }
    finally:
        eng.close()


def table(out: dict, store: str, rounds: int) -> str:
    """The results table: one row per policy, raw and device-equivalent apart, the simulator beside the measure."""
    em = out["emulation"]
    load = f"{out['loadavg_start'][0]:.1f}-{out['loadavg_end'][0]:.1f}"
    lines = [
        f"`{Path(store).name}`, emulated {em['profile']}: k = {em['dilation_k']:.3g} (host "
        f"{1e3 * em['host_s_per_token']:.1f} ms, device {1e3 * em['device_s_per_token']:.2f} ms per token), "
        f"median of {rounds} interleaved rounds, load {load}; device-equivalent = raw x k",
        "",
        "| policy | budget | raw tok/s | device-eq. tok/s | simulator (device-eq.) | error | loading share "
        "| counting blob decode |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p, r in out["policies"].items():
        m = r["median_raw"]
        lines.append(
            f"| {p} | {r['budget_share']:.0%} | {m['decode_tps']:.3g} "
            f"| {r['device_equivalent_decode_tps']:.3g} | {r['simulator_predicted_device_tps']:.3g} "
            f"| {100 * r['simulator_error']:+.1f}% "
            f"| {100 * m['loading_share']:.1f}% | {100 * m['loading_share_with_blob_decode']:.1f}% |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store")
    ap.add_argument("--device", default="agx-orin")
    ap.add_argument("--budget", type=float, default=0.35, help="share of the int4 expert bytes (cached presets)")
    ap.add_argument("--policies", nargs="+", default=["load-on-demand-int4", "lru"])
    ap.add_argument("--tokens", type=int, default=8, help="decode tokens per run")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", default=None)
    add_results_arg(ap, "rewrite the table between FILE's <!-- MARK:begin/end --> (without FILE: docs/results/MARK.md)")
    ap.add_argument("--mark", default="emulate-validate", help="the table's markers (default emulate-validate)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from fate_edge.format.store import ExpertStore
    from fate_edge.planning.emulation import calibrate
    from fate_edge.planning.host_costs import measure_host_costs
    from fate_edge.planning.plan_trace import sample_token_ids
    from fate_edge.planning.planner import simulate_policy
    from fate_edge.planning.simulate import scale_costs
    from fate_edge.runtime.policy import PRESETS
    from fate_edge.tokenizer import Tokenizer

    store = ExpertStore(args.store)
    ids = sample_token_ids(Tokenizer(args.store), args.prompt)
    total = len(store.index["moe_layers"]) * store.index["num_experts"] * store.expert_bytes(4)
    budget = int(args.budget * total)
    load0 = os.getloadavg()
    em = calibrate(args.device, args.store, ids, tokens=args.tokens, workers=args.workers)
    print(
        f"k = {em.k:.3g}: host {em.host_s_per_token * 1e3:.1f} ms, device {em.device_s_per_token * 1e3:.2f} ms per "
        f"token; link {em.emulated.bandwidth_bytes_per_s / 1e6:.1f} MB/s; {em.io_note}",
        flush=True,
    )
    # The simulator's costs, as the planner measures them (LRU probe under the budget), on the emulated link.
    costs, _, trace = measure_host_costs(
        args.store,
        budget,
        em.emulated,
        ids,
        workers=args.workers,
        decode_tokens=args.tokens,
        direct_io=em.direct_io,
        predictor_probe=any(PRESETS[p].predictor for p in args.policies),
    )
    device_costs = scale_costs(costs, 1 / em.k)
    print(f"host costs: {costs.describe()}\ndevice costs: {device_costs.describe()}", flush=True)
    measured: dict[str, list[dict]] = {p: [] for p in args.policies}
    for rnd in range(args.rounds):
        for p in args.policies:
            b = budget if PRESETS[p].cache else total
            r = run_policy(args.store, b, p, em, ids, args.tokens, args.workers)
            measured[p].append(r)
            print(
                f"round {rnd + 1} {p}: {r['decode_tps']:.3f} raw tok/s, stall {r['stall_ms']:.0f} ms, compute "
                f"{r['compute_ms']:.0f} ms, blob decode {r['blob_decode_ms']:.0f} ms, loading share "
                f"{100 * r['loading_share']:.1f}% (load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
    out = {
        "emulation": em.to_dict(),
        "host_costs": costs.describe(),
        "device_costs": device_costs.describe(),
        "loadavg_start": load0,
        "loadavg_end": os.getloadavg(),
        "threads": args.threads,
        "policies": {},
    }
    eb, slot = store.expert_bytes(4), store.precisions[4].slot_bytes
    for p, runs in measured.items():
        b = budget if PRESETS[p].cache else total
        pred = simulate_policy(trace, PRESETS[p], b, eb, slot, em.link, device_costs).tokens_per_s
        med = {
            key: statistics.median(r[key] for r in runs)
            for key in (
                "decode_tps",
                "stall_ms",
                "compute_ms",
                "blob_decode_ms",
                "loading_share",
                "loading_share_with_blob_decode",
            )
        }
        dev = med["decode_tps"] * em.k
        out["policies"][p] = {
            "median_raw": med,
            "device_equivalent_decode_tps": dev,
            "budget_share": b / total,
            "simulator_predicted_device_tps": pred,
            "simulator_error": pred / dev - 1,
            "runs": runs,
        }
        print(
            f"{p}: raw {med['decode_tps']:.3f} tok/s, device-equivalent {dev:.2f} tok/s, simulator {pred:.2f} "
            f"({100 * (pred / dev - 1):+.1f}%), loading share {100 * med['loading_share']:.1f}% "
            f"({100 * med['loading_share_with_blob_decode']:.1f}% counting blob decode as loading)",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    text = table(out, args.store, args.rounds)
    print(text)
    if args.results:
        replace_between_markers(results_file(args.mark) if args.results is True else args.results, args.mark, text)


if __name__ == "__main__":
    main()
