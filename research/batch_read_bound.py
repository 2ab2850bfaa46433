"""How far any cache could lower the expert bytes a batch reads per token: the engine's reads beside Belady-MIN's on
the same recorded calls (docs/batching.md, "The bound on bytes per token").

Serves the throughput bench's requests (``bench_prompts``) on one batching engine, as ``fate_edge_lab.bench.throughput``
does: one at a time, then all at once, after a warm-up round each, and records every MoE layer call
(``fate_edge_lab.bounds.read_bound.CallRecorder``). For each mode it prints the engine's expert reads per generated
token (demand, prefetch and wasted) and the fewest any cache with the whole budget as room could make on the same calls
(``fewest_reads_warm``: Belady-MIN over one partition), with the room the engine's cache has (its budget less its
read buffers) and with the whole budget. Belady starts empty where the engine starts warm, so its count less one
full cache is what the table takes: a lower bound on the batch's reads, and so an upper bound on the ratio of
today's alone reads to the batch's.

    python research/batch_read_bound.py --budgets 0.35 0.5 0.75 --threads 1
    python research/batch_read_bound.py --model /tmp/qwen-moe-2l-int4 --budgets 0.35 --max-tokens 16
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge_lab.bench.throughput import host_note
from fate_edge_lab.bench.throughput_rounds import (
    ThroughputConfig,
    bench_prompts,
    bytes_ratio,
    engine_kwargs,
    engine_store,
    ratio_text,
    run_round,
)
from fate_edge_lab.bounds.read_bound import CallRecorder, engine_rooms, fewest_reads_warm


def measure(cfg: ThroughputConfig) -> dict:
    store, budget = engine_store(cfg)
    prompts = bench_prompts(cfg.concurrency)
    engine = Engine(EngineConfig(store, budget, max_batch=cfg.concurrency, **engine_kwargs(cfg)))
    expert_bytes = engine.store.expert_bytes(engine.policy.bits)
    layers = len(engine.store.index["moe_layers"])
    rooms = engine_rooms(engine)
    capacity, cache_entries = rooms["whole_budget"], rooms["cache_room"]
    rec = CallRecorder()
    engine.model.observers.append(rec)
    out: dict = {
        "budget_fraction": cfg.budget_fraction,
        "capacity_experts": capacity,
        "cache_experts": cache_entries,
        "expert_bytes": expert_bytes,
    }
    try:
        for mode, concurrent in (("alone", False), ("batched", True)):
            run_round(engine, prompts, cfg.max_tokens, concurrent)  # warm: the measured rounds start from a full cache
            rec.take()
            s0 = engine.stats.snapshot()
            rounds = [run_round(engine, prompts, cfg.max_tokens, concurrent) for _ in range(cfg.rounds)]
            st = engine.stats.minus(s0)
            calls = rec.take()
            tokens = sum(r["tokens"] for r in rounds)
            engine_reads = (st.demand_bytes + st.prefetch_bytes + st.wasted_bytes) / expert_bytes
            bound = fewest_reads_warm(calls, capacity, layers)
            in_cache = fewest_reads_warm(calls, cache_entries, layers)
            out[mode] = {
                "tokens": tokens,
                "calls": len(calls),
                "experts_per_call": sum(len(ids) for _, ids in calls) / max(1, len(calls)),
                "engine_reads_per_token": engine_reads / tokens,
                "belady_reads_per_token": bound / tokens,
                "belady_in_cache_reads_per_token": in_cache / tokens,
                "hit_rate": sum(r["hit_rate"] for r in rounds) / len(rounds),
                "demand_prefetch_wasted_reads_per_token": [
                    b / expert_bytes / tokens for b in (st.demand_bytes, st.prefetch_bytes, st.wasted_bytes)
                ],
            }
    finally:
        engine.close()
    a, b = out["alone"], out["batched"]
    out["ratio_engine"] = bytes_ratio(a["engine_reads_per_token"], b["engine_reads_per_token"])
    # the most any cache could lower the batch's reads below today's alone: in the engine's cache room, and with
    # the whole budget as room (no read buffers)
    out["ratio_bound_in_cache"] = bytes_ratio(a["engine_reads_per_token"], b["belady_in_cache_reads_per_token"])
    out["ratio_bound"] = bytes_ratio(a["engine_reads_per_token"], b["belady_reads_per_token"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a store (default: the bundled model)")
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.35])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--policy", default="fate-edge")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    runs = []
    for f in a.budgets:
        cfg = ThroughputConfig(
            model=a.model,
            dtype="bfloat16" if a.model else "float32",
            threads=a.threads,
            budget_fraction=f,
            max_tokens=a.max_tokens,
            concurrency=a.concurrency,
            rounds=a.rounds,
            policy=a.policy,
        )
        runs.append(measure(cfg))
    print(
        "| budget (experts: budget, cache) | experts a call, alone / batched | reads a token alone: engine / Belady "
        "| batched: engine / Belady | alone / batched, engine | the most any cache could give: in the cache's room "
        "/ the whole budget's |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for r in runs:
        a_, b_ = r["alone"], r["batched"]
        print(
            f"| {r['budget_fraction']:.0%} ({r['capacity_experts']}, {r['cache_experts']}) "
            f"| {a_['experts_per_call']:.1f} / {b_['experts_per_call']:.1f} "
            f"| {a_['engine_reads_per_token']:.2f} / {a_['belady_in_cache_reads_per_token']:.2f} "
            f"| {b_['engine_reads_per_token']:.2f} / {b_['belady_in_cache_reads_per_token']:.2f} "
            f"| {ratio_text(r['ratio_engine'])} "
            f"| {ratio_text(r['ratio_bound_in_cache'])} / {ratio_text(r['ratio_bound'])} |"
        )
    if a.out is not None:
        a.out.write_text(json.dumps({"runs": runs, "host": host_note()}, indent=1) + "\n")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
