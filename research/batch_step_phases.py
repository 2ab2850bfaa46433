"""Where a batched decode step goes, per phase, and what its cache misses cost it (docs/batching.md).

Serves the throughput bench's requests, 8 at once (``--batch``), after a warm-up round, and times per step the
batcher's step and the phases inside it (wall, and the batcher thread's CPU) by wrapping the functions that do them:
the routing hook (which submits the demand reads), the reads turned into experts (``_consume``: wait, decode,
hand-off to the cache), the experts computed (``group_rows``) and the attention. Each budget and batch runs in a
fresh engine, so the same steps compare at a cache that misses (35%) and one that holds every expert (100%).

    python research/batch_step_phases.py --budgets 0.35 1.0 --threads 1
    python research/batch_step_phases.py --budgets 1.0 --batch 1 2 4 8
    python research/batch_step_phases.py --budgets 0.35 --buffered   # page-cache reads instead of O_DIRECT
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import fate_edge.model.batch_step as batch_step
import fate_edge.model.routed_experts as routed_experts
from fate_edge.runtime.batch import Batcher
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge.runtime.scheduler import Scheduler
from fate_edge_lab.bench.throughput import host_note
from fate_edge_lab.bench.throughput_rounds import (
    ThroughputConfig,
    bench_prompts,
    engine_kwargs,
    engine_store,
    run_round,
)

PHASES: list[tuple[Any, str, str]] = [  # (owner, attribute, phase)
    (Batcher, "_step", "step"),
    (Scheduler, "on_route", "routing hook (submits the reads)"),
    (Scheduler, "_consume", "reads into experts (wait, decode, hand-off)"),
    (routed_experts, "group_rows", "experts computed"),
    (batch_step, "_attention", "attention"),
]


def _timed(f: Callable, totals: dict[str, list[float]], phase: str) -> Callable:
    def wrapper(*args: Any, **kw: Any) -> Any:
        t, c = time.perf_counter(), time.thread_time()
        try:
            return f(*args, **kw)
        finally:
            row = totals[phase]
            row[0] += time.perf_counter() - t
            row[1] += time.thread_time() - c
            row[2] += 1

    return wrapper


def measure(
    budget_fraction: float, threads: int, rounds: int, direct_io: bool, model: str | None, batch: int = 8
) -> dict:
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in PHASES]
    for owner, name, phase in PHASES:
        setattr(owner, name, _timed(getattr(owner, name), totals, phase))
    # the model calls the hook through __call__
    Scheduler.__call__ = Scheduler.on_route  # type: ignore[method-assign]
    cfg = ThroughputConfig(
        model=model, dtype="bfloat16" if model else "float32", threads=threads, budget_fraction=budget_fraction
    )
    store, budget = engine_store(cfg)
    engine = Engine(EngineConfig(store, budget, max_batch=8, direct_io=direct_io, **engine_kwargs(cfg)))
    try:
        prompts = bench_prompts(batch)
        run_round(engine, prompts, cfg.max_tokens, True)
        totals.clear()
        before = engine.stats.snapshot()
        for _ in range(rounds):
            run_round(engine, prompts, cfg.max_tokens, True)
        stats = engine.stats.minus(before)
    finally:
        engine.close()
        for owner, name, f in saved:
            setattr(owner, name, f)
        Scheduler.__call__ = Scheduler.on_route  # type: ignore[method-assign]
    steps = max(1, int(totals["step"][2]))
    return {
        "budget_fraction": budget_fraction,
        "batch": batch,
        "direct_io": direct_io,
        "steps": steps,
        "misses_per_step": stats.misses / steps,
        "stall_ms_per_step": 1e3 * stats.stall_s / steps,
        "phases_ms_per_step": {p: {"wall": 1e3 * w / steps, "cpu": 1e3 * c / steps} for p, (w, c, _) in totals.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a store (default: the bundled model)")
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.35, 1.0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, nargs="+", default=[8], help="sequences at once (1: the one-token step)")
    ap.add_argument("--buffered", action="store_true", help="read through the page cache, not O_DIRECT")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    runs = [measure(f, a.threads, a.rounds, not a.buffered, a.model, n) for f in a.budgets for n in a.batch]
    for r in runs:
        print(
            f"budget {r['budget_fraction']:.0%}, {r['batch']} at once: {r['misses_per_step']:.1f} misses a step, "
            f"stall {r['stall_ms_per_step']:.2f} ms"
        )
        for phase, t in r["phases_ms_per_step"].items():
            print(f"  {phase:45s} {t['wall']:6.2f} ms wall, {t['cpu']:6.2f} ms CPU a step")
    if a.out is not None:
        a.out.write_text(json.dumps({"runs": runs, "host": host_note()}, indent=1) + "\n")


if __name__ == "__main__":
    main()
