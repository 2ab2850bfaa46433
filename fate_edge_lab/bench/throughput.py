"""Throughput mode: N concurrent requests served as one batch, side by side with the same requests one at a time.

    python -m fate_edge_lab.bench.throughput --model STORE --budget-fraction 0.35 --concurrency 8 \
        --out docs/results/batching-NAME.json --publish

``--publish`` rewrites the table in docs/results/batching.md from every docs/results/batching-*.json run
(``throughput_report``). ``--emulate DEVICE`` serves them on an emulated device (``throughput_emulated``; its runs go
to docs/results/batching-emulated-NAME.json and docs/results/batching-emulated.md).

One batching engine (max_batch N) serves both modes: ``alone``, the requests one after another (each on the
single-sequence decode step), and ``batched``, the N requests from N threads at once; the expert cache carries over
between them, as in a daemon whose clients come one at a time, then all together. (``--emulate`` and ``--sweep``
load a second, one-at-a-time engine: emulation dilates each mode's link on its own.) Rounds alternate which goes
first; the figures are medians over rounds. Reported per mode:
total decode tokens/s (generated tokens over the round's wall time), per-request time to first token and per-token
latency percentiles (gaps between a request's tokens), and expert bytes read per generated token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fate_edge.apps.command_line import device_name, emulated_device
from fate_edge_lab.bench.throughput_rounds import (
    PROMPTS,
    ThroughputConfig,
    bench_prompts,
    bytes_ratio,
    engine_kwargs,
    engine_store,
    host_note,
    median_rounds,
    ratio_text,
    run_round,
    serve_both,
    serve_request,
)


def engines(cfg: ThroughputConfig, max_batch: int):
    """(store, budget, the one-at-a-time engine, the batching engine) for ``cfg``."""
    from fate_edge.runtime.engine import Engine
    from fate_edge.runtime.engine_config import EngineConfig

    store, budget = engine_store(cfg)
    kw = engine_kwargs(cfg)
    return (
        store,
        budget,
        Engine(EngineConfig(store, budget, max_batch=1, **kw)),
        Engine(EngineConfig(store, budget, max_batch=max_batch, **kw)),
    )


def run(cfg: ThroughputConfig) -> dict:
    """Both modes on one batching engine: one request at a time it runs the single-sequence decode step, on the same
    thread as its batches. Two engines computing on two threads would each keep an OpenMP team, and libgomp then
    throttles both teams' spin-waiting (runtime.load_threads): at 2 threads on 2 cores that slowed the bundled model
    3-4x in both modes."""
    from fate_edge.runtime.engine import Engine
    from fate_edge.runtime.engine_config import EngineConfig

    store, budget = engine_store(cfg)
    engine = Engine(EngineConfig(store, budget, max_batch=cfg.concurrency, **engine_kwargs(cfg)))
    prompts = bench_prompts(cfg.concurrency)
    try:
        served = serve_both(engine, engine, prompts, cfg)
    finally:
        engine.close()
    out: dict[str, Any] = {
        "alone": median_rounds(served.rounds["alone"]),
        "batched": median_rounds(served.rounds["batched"]),
        "single_request": median_rounds(served.single),
        "rounds": served.rounds,
        "mean_batch": served.mean_batch,
    }
    a, bt, one = out["alone"], out["batched"], out["single_request"]
    out["ratios"] = {
        "tok_s_batched_over_alone": bt["tok_s"] / a["tok_s"],
        "token_p50_batched_over_single": bt["token_p50_s"] / one["token_p50_s"],
        "bytes_per_token_alone_over_batched": bytes_ratio(a["bytes_per_token"], bt["bytes_per_token"]),
    }
    out["config"] = asdict(cfg) | {"store": str(store), "budget_bytes": budget}
    out["host"] = host_note(cfg.device)
    return out


def sweep(cfg: ThroughputConfig, batches: tuple[int, ...] = (1, 2, 4, 8)) -> dict:
    """The planner's roofline (planning.batch_size), calibrated on requests served alone and one step of two (the
    batched path's own cost: ``with_pair_probe``), beside the batched engine
    measured at each batch size: step time and decode tokens/s, predicted and measured. Every batch size serves the
    same ``max(batches)`` requests, ``b`` at a time, and the calibration serves them one at a time: a batch of one
    repeating one request would find its experts still cached from the round before (a hit rate of 0.94 against
    0.82 on the bundled model at 35%)."""
    from fate_edge_lab.bench.batch_size import choose_batch, measure_head_rate, step_costs, with_pair_probe

    store, budget, alone, batched = engines(cfg, max(batches))
    prompts = bench_prompts(max(batches))
    try:
        run_round(alone, PROMPTS[:1], 4, False)
        run_round(batched, PROMPTS[:2], 4, True)
        pairs: list[float] = []  # the planner's look at the batched path: two other requests at once, each round
        gaps: list[float] = []
        token_stats: list = []
        rounds: dict[int, list[dict]] = {b: [] for b in batches}
        for _ in range(cfg.rounds):  # interleaved: the calibration run and every batch size in each round
            for p in prompts:  # one at a time, each request's tokens beside their statistics
                record: dict = {}
                serve_request(alone, p, cfg.max_tokens, time.perf_counter(), record)
                n = min(len(record["gaps"]), len(alone.token_stats))  # token i's gap beside token i's statistics
                gaps += record["gaps"][:n]
                token_stats += alone.token_stats[:n]
            pairs.append(run_round(batched, PROMPTS[-2:], cfg.max_tokens, True)["token_p50_s"])
            for b in batches:
                rounds[b].append(run_round(batched, prompts, cfg.max_tokens, True, at_once=b))
        step_s = statistics.median(gaps)
        peak = measure_head_rate(alone.model, max(batches))  # the resident work's roof, in its own kernel
        costs = with_pair_probe(step_costs(alone, step_s, token_stats, peak, token_s=gaps), statistics.median(pairs))
        chosen, preds = choose_batch(costs, max(batches))
        measured = {b: median_rounds(rounds[b]) for b in batches}
    finally:
        alone.close()
        batched.close()
    rows = []
    for b in batches:
        pred, m = preds[b - 1], measured[b]
        rows.append(
            {
                "batch": b,
                "predicted_step_s": pred.step_s,
                "measured_step_p50_s": m["token_p50_s"],
                "predicted_decode_tok_s": pred.tokens_per_s,
                "measured_decode_tok_s": b / m["token_p50_s"],
                "predicted_union": pred.union,
                "predicted_reads": pred.reads,
                "bound": pred.bound,
                "terms_s": pred.terms,
                "measured_bytes_per_token": m["bytes_per_token"],
            }
        )
    return {
        "rows": rows,
        "chosen_batch": chosen,
        "costs": asdict(costs) | {"experts_per_layer": None, "cached": None},
        "config": asdict(cfg) | {"store": str(store), "budget_bytes": budget},
        "host": host_note(cfg.device),
    }


def main(argv: list[str] | None = None) -> int:
    d = ThroughputConfig()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--budget-fraction", type=float, default=d.budget_fraction)
    ap.add_argument("--concurrency", type=int, default=d.concurrency)
    ap.add_argument("--max-tokens", type=int, default=d.max_tokens)
    ap.add_argument("--rounds", type=int, default=d.rounds)
    ap.add_argument("--threads", type=int, default=d.threads)
    ap.add_argument("--policy", default=d.policy)
    ap.add_argument("--dtype", default=d.dtype)
    ap.add_argument("--device", type=device_name, default=d.device, help="cpu, cuda or cuda:N (not with --emulate)")
    ap.add_argument(
        "--resident-bits",
        type=int,
        choices=[4, 8],
        default=None,
        help="quantize the resident linears (on a CPU without native bf16, a dense bf16 GEMM of 8 rows "
        "costs 8 of one row: the int4 kernel's does not)",
    )
    ap.add_argument(
        "--emulate",
        type=emulated_device,
        default=None,
        metavar="DEVICE",
        help="device-faithful emulation (orin-nano, orin-nx, agx-orin, or a profile): each mode's link dilated by "
        "its own host/device ratio, figures device-equivalent (bench.throughput_emulated)",
    )
    ap.add_argument("--out", type=Path, required=True, help="JSON file to write")
    ap.add_argument("--publish", action="store_true", help="rewrite docs/results/batching.md from every run's JSON")
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="the planner's batch-size roofline beside measurements at batch 1, 2, 4 and 8",
    )
    a = ap.parse_args(argv)
    if a.concurrency < 1 or a.rounds < 1 or not 0 < a.budget_fraction <= 1:
        ap.error("--concurrency and --rounds must be >= 1 and --budget-fraction in (0, 1]")
    cfg = ThroughputConfig(
        a.model,
        a.budget_fraction,
        a.concurrency,
        a.max_tokens,
        a.rounds,
        a.threads,
        a.policy,
        a.dtype,
        a.resident_bits,
        a.device,
        a.emulate,
    )
    if a.emulate and a.device != "cpu":
        ap.error("--emulate runs on this host's CPU; leave out --device")
    if a.sweep and a.emulate:
        ap.error("--sweep runs on this host's timeline; leave out --emulate")
    if a.sweep:
        out = sweep(cfg)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1) + "\n")
        for r in out["rows"]:
            print(
                f"batch {r['batch']}: step {1e3 * r['predicted_step_s']:.1f} ms predicted, "
                f"{1e3 * r['measured_step_p50_s']:.1f} measured; decode {r['predicted_decode_tok_s']:.1f} tok/s "
                f"predicted, {r['measured_decode_tok_s']:.1f} measured ({r['bound']})"
            )
        print(f"chosen batch: {out['chosen_batch']}; load {out['host']['load_average']}")
        if a.publish:
            from fate_edge_lab.bench.throughput_report import publish_sweep_table

            print(publish_sweep_table(a.out.parent))
        return 0
    if a.emulate:
        from fate_edge_lab.bench.throughput_emulated import run_emulated

        out = run_emulated(cfg)
    else:
        out = run(cfg)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    r = out["ratios"]
    print(
        f"batched/alone tok/s {r['tok_s_batched_over_alone']:.2f}x, p50 token latency batched/single "
        f"{r['token_p50_batched_over_single']:.2f}x, bytes/token alone/batched "
        f"{ratio_text(r['bytes_per_token_alone_over_batched'])}; load {out['host']['load_average']}"
    )
    if a.publish and a.emulate:
        from fate_edge_lab.bench.throughput_report import publish_emulated_table

        print(publish_emulated_table(a.out.parent))
    elif a.publish:
        from fate_edge_lab.bench.throughput_report import publish_table

        print(publish_table(a.out.parent))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
