"""Throughput mode: N concurrent requests served as one batch, side by side with the same requests one at a time.

    python -m fate_edge.bench.throughput --model STORE --budget-fraction 0.35 --concurrency 8 \
        --out docs/results/batching-NAME.json --publish

``--publish`` rewrites the table in docs/results/batching.md from every docs/results/batching-*.json run
(``throughput_report``).

Both engines are loaded in one process with the same store, budget and policy: ``alone`` (max_batch 1, the
single-sequence decode path) serves the requests one after another; ``batched`` (max_batch N) gets them from N
threads at once. Rounds alternate which goes first; the figures are medians over rounds. Reported per mode:
total decode tokens/s (generated tokens over the round's wall time), per-request time to first token and per-token
latency percentiles (gaps between a request's tokens), and expert bytes read per generated token.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from fate_edge.bench.host import cpu_model, load_average

PROMPTS = [
    "def main():",
    "import os\nimport sys\n",
    "class Point:\n    def __init__(self, x",
    "x = ",
    "# read the file line by line\n",
    "for i in range(10):",
    "def parse(line):",
    "from typing import",
    "if __name__ ==",
    "while True:",
    "return [x for",
    "with open(path) as f:",
    "try:\n    import",
    "print(",
    "async def fetch(",
    "@dataclass\nclass Config:",
]


@dataclass
class ThroughputConfig:
    model: str | None = None  # expert store or model directory (None: the bundled model)
    budget_fraction: float = 0.35  # of every expert at the streamed precision
    concurrency: int = 8
    max_tokens: int = 32
    rounds: int = 3
    threads: int = 2
    policy: str = "fate-edge"
    dtype: str = "float32"
    resident_bits: int | None = None  # 4 or 8: attention, shared experts and lm_head quantized at load


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


def _serve(engine, prompt: str, max_tokens: int, t_submit: float, record: dict) -> None:
    from fate_edge.runtime.generate import GenerateConfig

    times = []
    for _ in engine.stream(prompt, GenerateConfig(max_tokens=max_tokens, ignore_eos=True)):
        times.append(time.perf_counter())
    record["ttft"] = times[0] - t_submit
    record["gaps"] = [b - a for a, b in zip(times, times[1:])]
    record["tokens"] = len(times)


def run_round(engine, prompts: list[str], max_tokens: int, concurrent: bool) -> dict:
    """One round: every prompt served (at once, or one after another); the round's figures."""
    s0 = engine.stats.snapshot()
    records = [{} for _ in prompts]
    t0 = time.perf_counter()
    if concurrent:
        threads = [
            threading.Thread(target=_serve, args=(engine, p, max_tokens, t0, r)) for p, r in zip(prompts, records)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for p, r in zip(prompts, records):
            _serve(engine, p, max_tokens, t0, r)  # a request's TTFT includes waiting for the ones before it
    wall = time.perf_counter() - t0
    s = engine.stats.minus(s0)
    tokens = sum(r["tokens"] for r in records)
    gaps = [g for r in records for g in r["gaps"]]
    ttft = [r["ttft"] for r in records]
    read = s.demand_bytes + s.prefetch_bytes + s.wasted_bytes
    return {
        "wall_s": wall,
        "tokens": tokens,
        "tok_s": tokens / wall,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p90_s": percentile(ttft, 0.9),
        "token_p50_s": percentile(gaps, 0.5),
        "token_p90_s": percentile(gaps, 0.9),
        "token_p99_s": percentile(gaps, 0.99),
        "bytes_per_token": read / max(1, tokens),
        "hit_rate": s.hit_rate,
    }


def _median(rounds: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}


def engines(cfg: ThroughputConfig, max_batch: int):
    """(store, budget, the one-at-a-time engine, the batching engine) for ``cfg``."""
    from fate_edge.bundled import bundled_model_dir
    from fate_edge.format.converted_stores import ensure_store
    from fate_edge.format.store import ExpertStore
    from fate_edge.runtime.engine import Engine

    torch.set_num_threads(cfg.threads)
    store = ensure_store(cfg.model or bundled_model_dir(), progress=False)
    s = ExpertStore(store)
    budget = int(cfg.budget_fraction * s.expert_bytes(4) * len(s.index["moe_layers"]) * s.index["num_experts"])
    kw = dict(policy=cfg.policy, dtype=cfg.dtype, device="cpu", resident_bits=cfg.resident_bits)
    return store, budget, Engine(store, budget, max_batch=1, **kw), Engine(store, budget, max_batch=max_batch, **kw)


def run(cfg: ThroughputConfig) -> dict:
    store, budget, alone, batched = engines(cfg, cfg.concurrency)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(cfg.concurrency)]
    try:
        run_round(alone, prompts[:2], 4, False)  # warm both: first-call allocations, kernels chosen
        run_round(batched, prompts[:2], 4, True)
        single = [run_round(alone, prompts[:1], cfg.max_tokens, False) for _ in range(cfg.rounds)]
        results: dict[str, list[dict]] = {"alone": [], "batched": []}
        for r in range(cfg.rounds):
            order = [("alone", alone, False), ("batched", batched, True)]
            for name, engine, conc in order if r % 2 == 0 else order[::-1]:
                results[name].append(run_round(engine, prompts, cfg.max_tokens, conc))
        b = batched.batcher.stats
        mean_batch = b.sequences_stepped / b.steps if b.steps else 0.0
    finally:
        alone.close()
        batched.close()
    out = {
        "alone": _median(results["alone"]),
        "batched": _median(results["batched"]),
        "single_request": _median(single),
        "rounds": results,
        "mean_batch": mean_batch,
    }
    a, bt, one = out["alone"], out["batched"], out["single_request"]
    out["ratios"] = {
        "tok_s_batched_over_alone": bt["tok_s"] / a["tok_s"],
        "token_p50_batched_over_single": bt["token_p50_s"] / one["token_p50_s"],
        "bytes_per_token_alone_over_batched": a["bytes_per_token"] / max(1e-9, bt["bytes_per_token"]),
    }
    out["config"] = asdict(cfg) | {"store": str(store), "budget_bytes": budget}
    out["host"] = host_note()
    return out


def sweep(cfg: ThroughputConfig, batches: tuple[int, ...] = (1, 2, 4, 8)) -> dict:
    """The planner's roofline (planning.batch_size), calibrated on one request alone, beside the batched engine
    measured at each batch size: step time and decode tokens/s, predicted and measured."""
    from fate_edge.planning.batch_size import choose_batch, measure_peak_flops, step_costs

    store, budget, alone, batched = engines(cfg, max(batches))
    try:
        run_round(alone, PROMPTS[:1], 4, False)
        run_round(batched, PROMPTS[:2], 4, True)
        single, rounds = [], {b: [] for b in batches}
        for _ in range(cfg.rounds):  # interleaved: the calibration run and every batch size in each round
            single.append(run_round(alone, PROMPTS[:1], cfg.max_tokens, False))
            for b in batches:
                rounds[b].append(
                    run_round(batched, [PROMPTS[i % len(PROMPTS)] for i in range(b)], cfg.max_tokens, True)
                )
        step_s = statistics.median(r["token_p50_s"] for r in single)
        costs = step_costs(alone, step_s, alone.token_stats, measure_peak_flops())
        chosen, preds = choose_batch(costs, max(batches))
        measured = {b: _median(rounds[b]) for b in batches}
    finally:
        alone.close()
        batched.close()
    rows = []
    for b in batches:
        p, m = preds[b - 1], measured[b]
        rows.append(
            {
                "batch": b,
                "predicted_step_s": p.step_s,
                "measured_step_p50_s": m["token_p50_s"],
                "predicted_decode_tok_s": p.tokens_per_s,
                "measured_decode_tok_s": b / m["token_p50_s"],
                "predicted_union": p.union,
                "predicted_reads": p.reads,
                "bound": p.bound,
                "terms_s": p.terms,
                "measured_bytes_per_token": m["bytes_per_token"],
            }
        )
    return {
        "rows": rows,
        "chosen_batch": chosen,
        "costs": asdict(costs) | {"experts_per_layer": None, "cached": None},
        "config": asdict(cfg) | {"store": str(store), "budget_bytes": budget},
        "host": host_note(),
    }


def host_note() -> dict:
    cpu = cpu_model() or platform.processor() or ""
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "load_average": load_average(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
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
    ap.add_argument(
        "--resident-bits",
        type=int,
        choices=[4, 8],
        default=None,
        help="quantize the resident linears (on a CPU without native bf16, a dense bf16 GEMM of 8 rows "
        "costs 8 of one row: the int4 kernel's does not)",
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
        a.model, a.budget_fraction, a.concurrency, a.max_tokens, a.rounds, a.threads, a.policy, a.dtype, a.resident_bits
    )
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
            from fate_edge.bench.throughput_report import publish_sweep_table

            print(publish_sweep_table(a.out.parent))
        return 0
    out = run(cfg)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    r = out["ratios"]
    print(
        f"batched/alone tok/s {r['tok_s_batched_over_alone']:.2f}x, p50 token latency batched/single "
        f"{r['token_p50_batched_over_single']:.2f}x, bytes/token alone/batched "
        f"{r['bytes_per_token_alone_over_batched']:.2f}x; load {out['host']['load_average']}"
    )
    if a.publish:
        from fate_edge.bench.throughput_report import publish_table

        print(publish_table(a.out.parent))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
