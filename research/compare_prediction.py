"""Where the simulator's token time departs from the engine's (issue 39, item 2): term by term, on one routing.

Probes the engine as ``auto_plan`` does (LRU decode: host costs and the routing), then for each policy simulates that
routing and runs the engine on the same prompt (greedy: the same tokens, so the same routing) under the same link,
and prints per decode token: compute, stall, blob decoding, predicting, total, and misses / reads, simulated beside
measured. With ``--emulate`` the link is the device's dilated one, as ``fate-edge bench --emulate`` runs it.

    python research/compare_prediction.py --emulate orin-nano --budgets 0.2 0.35 0.5 \\
        --policies fate-edge planned
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def engine_run(store, budget: int, policy, link, direct_io: bool, ids: list[int], tokens: int) -> dict:
    """The engine's decode of ``tokens`` tokens after ``ids``, per token: wall, stall, consume, predict, misses."""
    from fate_edge.devices.link import ThrottledLink

    from fate_edge.runtime.engine import Engine
    from fate_edge.runtime.engine_config import EngineConfig
    from fate_edge.runtime.generate import GenerateConfig

    out = {}
    for _attempt in range(2):  # the first warms torch and checks each blob's CRC, as the planner's probe does
        with Engine(
            EngineConfig(
                store, budget, policy, link=ThrottledLink(link) if link else None, direct_io=direct_io, workers=2
            )
        ) as eng:
            times = []
            for _ in eng.stream(ids, GenerateConfig(max_tokens=tokens + 1, ignore_eos=True)):
                times.append(time.perf_counter())
            st = eng.token_stats
            n = len(times) - 1
            wall = times[-1] - times[0]
            dec = st[-n:]
            out = {
                "tokens": n,
                "total": wall / n,
                "stall": sum(s.stall_s for s in dec) / n,
                "consume": sum(s.consume_s for s in dec) / n,
                "predict": sum(s.predict_s for s in dec) / n,
                "misses": sum(s.misses for s in dec) / n,
                "prefetch_hits": sum(s.prefetch_hits for s in dec) / n,
                "hits": sum(s.hits for s in dec) / n,
                "read_mb": sum(s.demand_bytes + s.prefetch_bytes + s.wasted_bytes for s in dec) / n / 1e6,
            }
            out["compute"] = out["total"] - out["stall"] - out["consume"] - out["predict"]
            out["median_total"] = float(np.median(np.diff(times)))
    return out


def sim_row(r, costs, layers: int) -> dict:
    n = r.tokens
    consume = costs.consume_s * (r.misses + r.prefetch_hits) / n
    return {
        "tokens": n,
        "total": r.total_s / n,
        "stall": r.stall_s / n - consume,
        "consume": consume,
        "predict": None,
        "compute": r.total_s / n - r.stall_s / n,
        "misses": r.misses / n,
        "prefetch_hits": r.prefetch_hits / n,
        "hits": r.hits / n,
        "read_mb": (r.demand_bytes + r.prefetch_bytes + r.wasted_bytes) / n / 1e6,
    }


def main() -> None:
    from fate_edge.format.store import ExpertStore
    from fate_edge.planning.emulation import calibrate, store_side
    from fate_edge.planning.host_costs import measure_host_costs
    from fate_edge.planning.plan_presets import preset_candidates
    from fate_edge.planning.plan_trace import describe_store
    from fate_edge.planning.planner import plan, probe_error, simulate_policy
    from fate_edge_lab.bench.prepare import make_prompts

    ap = argparse.ArgumentParser()
    ap.add_argument("--store", default=None, help="default: the bench's inflated store")
    ap.add_argument("--emulate", default=None)
    ap.add_argument("--host-ms", type=float, default=None, help="pin k: this host's decode ms per token (else probed)")
    ap.add_argument("--budgets", nargs="+", type=float, default=[0.35])
    ap.add_argument("--policies", nargs="+", default=["fate-edge", "planned"])
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=48)
    args = ap.parse_args()
    store_dir = args.store
    if store_dir is None:
        from fate_edge_lab.bench.config import BenchConfig
        from fate_edge_lab.bench.prepare import prepare_model

        store_dir = str(prepare_model(BenchConfig())[0])
    store = ExpertStore(store_dir)
    ids = make_prompts(store.path, [args.prompt_tokens])[0][args.prompt_tokens]
    link, direct, k = None, True, 1.0
    if args.emulate:
        em = calibrate(
            args.emulate,
            store_dir,
            ids[:32],
            side=store_side(store_dir),
            host_s_per_token=args.host_ms / 1e3 if args.host_ms else None,
        )
        link, direct, k = em.emulated, em.direct_io, em.k
        print(
            f"emulating {em.profile}: k {k:.3g}, link {link.bandwidth_bytes_per_s / 1e9:.4g} GB/s "
            f"{link.latency_s * 1e6:.0f} us, {'O_DIRECT' if direct else 'buffered'}"
        )
    layers = len(store.index["moe_layers"])
    total = layers * store.index["num_experts"] * store.expert_bytes(4)
    for frac in args.budgets:
        budget = int(frac * total)
        costs, plink, trace = measure_host_costs(
            store_dir, budget, link, ids, decode_tokens=args.decode_tokens, direct_io=direct
        )
        describe_store(trace, store)
        expert, slot = store.expert_bytes(4), store.precisions[4].slot_bytes
        err = probe_error(trace, budget, expert, slot, plink, costs)
        presets = preset_candidates(args.emulate, store_dir)
        planned = plan(trace, budget, expert, slot, plink, costs, start=presets[0], presets=presets, margin=err)
        print(
            f"\n== budget {frac:.0%}: {costs.describe()}; probe (LRU) measured {trace.probe_tokens_per_s:.2f} "
            f"tok/s, simulator off by {100 * err:.1f}%; pick {planned.policy.name} "
            f"{planned.policy.allocation}/{planned.policy.eviction}/{planned.policy.predictor}"
        )
        pols = {"fate-edge": presets[0], "fate": presets[1], "planned": planned.policy}
        for name in args.policies:
            pol = pols.get(name) or __import__("fate_edge.runtime.policy", fromlist=["PRESETS"]).PRESETS[name]
            sim = sim_row(simulate_policy(trace, pol, budget, expert, slot, plink, costs), costs, layers)
            eng = engine_run(store_dir, budget, pol, link, direct, ids, args.decode_tokens)
            print(
                f"-- {name}: {pol.allocation}/{pol.eviction}/{pol.predictor} p={pol.lookahead} "
                f"w={pol.prefetch_width} preload={pol.preload}"
            )
            print(
                f"   {'':10s}"
                + "".join(
                    f"{c:>10s}"
                    for c in (
                        "tok/s",
                        "ms/tok",
                        "compute",
                        "stall",
                        "consume",
                        "predict",
                        "misses",
                        "pf hits",
                        "MB/tok",
                    )
                )
            )
            for label, row in (("simulated", sim), ("engine", eng)):
                print(
                    f"   {label:10s}{1 / row['total']:10.2f}{row['total'] * 1e3:10.2f}{row['compute'] * 1e3:10.2f}"
                    f"{row['stall'] * 1e3:10.2f}{row['consume'] * 1e3:10.2f}"
                    + (f"{row['predict'] * 1e3:10.2f}" if row["predict"] is not None else f"{'-':>10s}")
                    + f"{row['misses']:10.2f}{row['prefetch_hits']:10.2f}{row['read_mb']:10.2f}"
                )
            print(
                f"   prediction error {100 * (eng['total'] / sim['total'] - 1):+.1f}% (simulated tok/s over measured)",
                flush=True,
            )


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
