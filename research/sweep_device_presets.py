"""Sweep candidate fate-edge policies per device with the trace simulator, on each device's emulated timeline.

One planner probe of the real engine on this host (costs and a decode trace with every predictor's scores), then
per device: k from the profile's roofline (planning/emulation.py), the host costs scaled by 1/k, the device's own
link, and the simulator (no compute: seconds for thousands of policies). Stage 1 ranks the caches (allocation x
eviction, no prefetch); stage 2 tries every predictor / lookahead / width / gate on the best caches. Prints the
best per device and budget beside lru, fate, the old fate-edge and the oracle, with the miss breakdown of the
best (how many of its misses the predictor named, how many prefetches landed late), and writes JSON.

    python research/sweep_device_presets.py --out /tmp/sweep.json [--host-ms 11.4] [--trace /tmp/trace.pkl]
"""

from __future__ import annotations

import argparse
import itertools
import json
import pickle
import sys
import time
from pathlib import Path

import torch

from fate_edge.format.popularity import store_popularity
from fate_edge.format.store import ExpertStore
from fate_edge.planning.device_costs import DEVICES
from fate_edge.planning.emulation import calibrate, store_side
from fate_edge.planning.host_costs import measure_host_costs
from fate_edge.planning.plan_trace import sample_token_ids
from fate_edge.planning.simulate import scale_costs, simulate
from fate_edge.runtime.budget import plan_budget
from fate_edge.runtime.policy import PRESETS, PolicyConfig
from fate_edge.tokenizer import Tokenizer

EVICTIONS = ("lru", "lfu", "arc", "lcu", "popularity", "next-use")
ALLOCATIONS = ("uniform", "shallow", "cost-aware", "global")
PREDICTORS = ("cross-layer", "cross-layer-norm", "learned")
LOOKAHEADS = (1, 2, 3)
WIDTHS = ("fate", 1, 2, 3, 4, 5)


def sim(trace, policy: PolicyConfig, budget: int, store: ExpertStore, link, costs):
    bits = policy.bits
    bp = plan_budget(budget, policy, store.expert_bytes(bits), store.precisions[bits].slot_bytes)
    preds = trace.predictions.get(policy.predictor) if policy.predictor else None
    inflight = bp.pool_buffers - bp.demand_buffers if policy.predictor else None
    return simulate(
        trace.expert_ids,
        preds,
        policy,
        bp.cache_bytes,
        store.expert_bytes(bits),
        link,
        costs,
        trace.num_experts,
        trace.num_layers,
        warm=trace.warm,
        max_inflight=inflight,
        popularity=store_popularity(store.path),
    )


def bench_store(path: str | None) -> ExpertStore:
    """The store at ``path``, or the bench's inflated bundled model (built on first use)."""
    if path is None:
        from fate_edge_lab.bench.config import BenchConfig
        from fate_edge_lab.bench.prepare import prepare_model

        path = str(prepare_model(BenchConfig())[0])
    return ExpertStore(path)


def device_timeline(device: str, store_dir: str, ids: list[int], costs, host_s: float, side, moe: int):
    """The emulation of ``store_dir`` on ``device`` (k from ``host_s`` per token) and the host ``costs`` on its
    timeline: scaled by 1/k, a layer's compute the roofline's, whatever the probe's drift."""
    em = calibrate(device, store_dir, ids, host_s_per_token=host_s, side=side)
    dev_costs = scale_costs(costs, 1 / em.k)
    dev_costs.layer_compute_s = em.device_s_per_token / moe
    return em, dev_costs


def label(p: PolicyConfig) -> str:
    if p.predictor is None:
        return f"{p.allocation}/{p.eviction}/no-prefetch"
    gate = "+gate" if p.prefetch_gate else ""
    return f"{p.allocation}/{p.eviction}/{p.predictor}/p{p.lookahead}/w{p.prefetch_width}{gate}"


def row(r) -> dict:
    return {
        "tps": r.tokens_per_s,
        "hit_rate": r.hit_rate,
        "misses": r.misses,
        "prefetch_hits": r.prefetch_hits,
        "late": r.late_prefetches,
        "prefetch_reads": len(r.prefetched),
        "wasted_mb": r.wasted_bytes / 1e6,
        "mb_per_token": (r.demand_bytes + r.prefetch_bytes + r.wasted_bytes) / 1e6 / max(1, r.tokens),
        "misses_by_layer": {str(layer): n for layer, n in sorted(r.layer_misses.items())},
    }


def sweep(trace, budget: int, store: ExpertStore, link, costs) -> dict:
    base = PRESETS["fate-edge"].with_(name="candidate")
    caches = {}
    for a, e in itertools.product(ALLOCATIONS, EVICTIONS):
        p = base.with_(allocation=a, eviction=e, predictor=None)
        caches[p] = sim(trace, p, budget, store, link, costs)
    best_caches = sorted(caches, key=lambda p: -caches[p].tokens_per_s)[:3]
    results = dict(caches)
    for c, q, la, w, g in itertools.product(best_caches, PREDICTORS, LOOKAHEADS, WIDTHS, (True, False)):
        if q not in trace.predictions:
            continue
        p = c.with_(
            predictor=q,
            lookahead=la,
            prefetch_width=w,
            prefetch_gate=g,
            min_prefetch_width=0,
            max_prefetch_width=max(2, w if isinstance(w, int) else 2),
        )
        results[p] = sim(trace, p, budget, store, link, costs)
    best = max(results, key=lambda p: results[p].tokens_per_s)
    ref = {
        name: sim(trace, PRESETS[name], budget, store, link, costs) for name in ("lru", "fate", "fate-edge", "oracle")
    }
    top = sorted(results, key=lambda p: -results[p].tokens_per_s)[:8]
    return {
        "best": label(best),
        "best_policy": dict(best.__dict__),
        "best_result": row(results[best]),
        "reference": {k: row(v) for k, v in ref.items()},
        "top": [(label(p), row(results[p])) for p in top],
        "best_with_prefetch": max(
            ((label(p), row(r)) for p, r in results.items() if p.predictor), key=lambda x: x[1]["tps"]
        ),
        "best_no_prefetch": max(((label(p), row(r)) for p, r in caches.items()), key=lambda x: x[1]["tps"]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default=None, help="expert store (default: the bench's inflated bundled model)")
    ap.add_argument("--devices", nargs="+", default=list(DEVICES))
    ap.add_argument("--budgets", nargs="+", type=float, default=[0.2, 0.35, 0.5])
    ap.add_argument(
        "--host-ms", type=float, default=None, help="pin this host's decode compute per token (else the probe's)"
    )
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--trace", default=None, help="pickle of (costs, trace): reused when it exists, else written")
    ap.add_argument(
        "--resident-bits",
        type=int,
        choices=(8, 4),
        default=None,
        help="the probe's resident linears at this precision (and the device roofline's)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    store = bench_store(args.store)
    args.store = str(store.path)
    total = store.expert_bytes(4) * len(store.index["moe_layers"]) * store.index["num_experts"]
    ids = sample_token_ids(Tokenizer(args.store))[:64]
    if args.trace and Path(args.trace).exists():
        costs, trace = pickle.loads(Path(args.trace).read_bytes())
    else:
        t0 = time.perf_counter()
        costs, _, trace = measure_host_costs(
            args.store,
            int(0.35 * total),
            None,
            ids,
            workers=1,
            decode_tokens=args.decode_tokens,
            direct_io=True,
            resident_bits=args.resident_bits,
            progress=lambda m: print(f"[probe] {m}", file=sys.stderr, flush=True),
        )
        print(f"probe: {time.perf_counter() - t0:.0f} s; {costs.describe()}", file=sys.stderr)
        if args.trace:
            Path(args.trace).write_bytes(pickle.dumps((costs, trace)))
    moe = len(store.index["moe_layers"])
    host_s = args.host_ms / 1e3 if args.host_ms else costs.layer_compute_s * moe
    side = store_side(args.store, resident_bits=args.resident_bits)
    out = {"store": args.store, "host_s_per_token": host_s, "host_costs": costs.__dict__, "devices": {}}
    for device in args.devices:
        em, dev_costs = device_timeline(device, args.store, ids, costs, host_s, side, moe)
        dev = out["devices"][device] = {
            "k": em.k,
            "device_ms_per_token": em.device_s_per_token * 1e3,
            "read_ms": em.link.transfer_time(em.expert_bytes) * 1e3,
            "budgets": {},
        }
        for b in args.budgets:
            res = sweep(trace, int(b * total), store, em.link, dev_costs)
            dev["budgets"][str(b)] = res
            ref = res["reference"]
            print(
                f"{device} {b:.0%}: best {res['best']} {res['best_result']['tps']:.0f} tok/s "
                f"(hit {res['best_result']['hit_rate']:.0%}); "
                + ", ".join(f"{k} {v['tps']:.0f}" for k, v in ref.items())
                + f"; best prefetching {res['best_with_prefetch'][0]} {res['best_with_prefetch'][1]['tps']:.0f}",
                flush=True,
            )
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
