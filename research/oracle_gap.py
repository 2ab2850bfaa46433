"""How much of the oracle's lead over fate-edge's device row is prediction (issue 14: within 1.15x of the oracle).

On the sweep's (costs, trace) pickle (research/sweep_device_presets.py --trace), on one device's emulated
timeline: the simulated fate-edge row the device resolves to and the oracle (each with its demand reads per MoE
layer, late prefetches and stall), the same row with its predictor replaced by the true experts of the next MoE
layers (perfect within-token prediction, for each lookahead and width), the row under every cache allocation and
eviction the engine has (Belady-MIN among them: perfect eviction), and each recorded predictor's recall of the
next layer's experts in its top k on the trace's decode.

    python research/oracle_gap.py --store S --trace T --device orin-nano --budget 0.35 --resident-bits 4
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fate_edge.predictors.evaluate import recall_at  # noqa: E402
from sweep_device_presets import bench_store, device_timeline, sim  # noqa: E402

from fate_edge.planning.device_presets import for_device_and_store  # noqa: E402
from fate_edge.planning.emulation import store_side  # noqa: E402
from fate_edge.planning.plan_trace import sample_token_ids  # noqa: E402
from fate_edge.planning.simulate import truth_scores  # noqa: E402
from fate_edge.runtime.policy import ALLOCATIONS, EVICTIONS, PRESETS  # noqa: E402
from fate_edge.tokenizer import Tokenizer  # noqa: E402


def next_layer_recall(trace, layers: list[int], top: int) -> dict[str, float]:
    """Per recorded predictor: the share of each token's true experts of layer i+1 among its ``top`` scores at i,
    averaged over the layer pairs (each pair has every decode token)."""
    out = {}
    for name, preds in trace.predictions.items():
        pairs = [
            recall_at(scores.topk(top, dim=1).indices, trace.expert_ids[target])
            for (src, target), scores in preds.items()
            if layers.index(target) == layers.index(src) + 1
        ]
        out[name] = sum(pairs) / max(1, len(pairs))
    return out


def stalls(r) -> dict:
    """Where a simulated run waits: demand reads (all, and per MoE layer), late prefetches, stall seconds."""
    return {
        "misses": r.misses,
        "layer_misses": dict(sorted(r.layer_misses.items())),
        "late_prefetches": r.late_prefetches,
        "stall_s": r.stall_s,
        "total_s": r.total_s,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--trace", required=True, help="the sweep's (costs, trace) pickle")
    ap.add_argument("--device", default="orin-nano")
    ap.add_argument("--budget", type=float, default=0.35)
    ap.add_argument("--resident-bits", type=int, choices=(8, 4), default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    store = bench_store(args.store)
    costs, trace = pickle.loads(Path(args.trace).read_bytes())
    layers = sorted(trace.expert_ids)
    moe = len(layers)
    budget = int(args.budget * store.expert_bytes(4) * moe * store.index["num_experts"])
    ids = sample_token_ids(Tokenizer(args.store))[:64]
    em, dev = device_timeline(
        args.device,
        args.store,
        ids,
        costs,
        costs.layer_compute_s * moe,
        store_side(args.store, resident_bits=args.resident_bits),
        moe,
    )
    row = for_device_and_store(PRESETS["fate-edge"], args.device, args.store, args.resident_bits)
    oracle_run = sim(trace, PRESETS["oracle"], budget, store, em.link, dev)
    row_run = sim(trace, row, budget, store, em.link, dev)
    oracle, got = oracle_run.tokens_per_s, row_run.tokens_per_s
    top = trace.expert_ids[layers[0]].shape[1]
    out = {
        "device": args.device,
        "budget": args.budget,
        "row": f"{row.predictor}/p{row.lookahead}/w{row.prefetch_width}",
        "row_tps": got,
        "oracle_tps": oracle,
        "row_stalls": stalls(row_run),
        "oracle_stalls": stalls(oracle_run),
        "recall_next_layer": next_layer_recall(trace, layers, top),
        "perfect": {},
        "caches": {},
    }
    print(
        f"{args.device} {args.budget:.0%}: fate-edge row ({out['row']}) {got:.1f} tok/s, oracle {oracle:.1f} "
        f"({oracle / got:.3f}x ahead)"
    )
    for name, s in (("row", out["row_stalls"]), ("oracle", out["oracle_stalls"])):
        print(
            f"  {name}: {s['misses']} demand reads (per MoE layer {s['layer_misses']}), {s['late_prefetches']} late "
            f"prefetches, {s['stall_s'] * 1e3:.0f} ms stalled of {s['total_s'] * 1e3:.0f} ms "
            f"({trace.expert_ids[layers[0]].shape[0]} tokens, device time)"
        )
    if row.predictor and not row.prefetch_gate:  # ungated: the predictor runs on every MoE layer of every token
        print(
            f"  row's predictor: {dev.predict_s * moe * trace.expert_ids[layers[0]].shape[0] * 1e3:.0f} ms "
            "(the oracle pays none)"
        )
    for allocation in ALLOCATIONS:
        for eviction in EVICTIONS:
            r = sim(trace, row.with_(allocation=allocation, eviction=eviction), budget, store, em.link, dev)
            out["caches"][f"{allocation}/{eviction}"] = r.tokens_per_s
            print(
                f"  the row with a {allocation} cache, {eviction} eviction: {r.tokens_per_s:.1f} tok/s "
                f"(oracle {oracle / r.tokens_per_s:.3f}x ahead)"
            )
    if row.predictor:
        trace.predictions[row.predictor] = truth_scores(trace.expert_ids, layers, 3, trace.num_experts)
        for lookahead in (1, 2, 3):
            for width in range(2, top + 2):
                p = row.with_(lookahead=lookahead, prefetch_width=width, max_prefetch_width=width)
                tps = sim(trace, p, budget, store, em.link, dev).tokens_per_s
                out["perfect"][f"p{lookahead}/w{width}"] = tps
                print(
                    f"  true experts as predictions, p{lookahead}/w{width}: {tps:.1f} tok/s "
                    f"(oracle {oracle / tps:.3f}x ahead)"
                )
    for name, share in out["recall_next_layer"].items():
        print(f"  {name}: {share:.1%} of the next layer's experts in its top {top}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
