"""The throughput mode's tables (``python -m fate_edge.bench.throughput --publish``): its runs side by side in
docs/results/batching.md, and its ``--sweep`` runs (the batch-size roofline beside measurement) in
docs/results/batching-sweep.md, each rebuilt from every run's JSON in docs/results."""

from __future__ import annotations

import json
from pathlib import Path


def table_row(name: str, r: dict) -> str:
    a, b, one, x = r["alone"], r["batched"], r["single_request"], r["ratios"]
    c, h = r["config"], r["host"]
    dtype = c["dtype"] + (f", int{c['resident_bits']} resident" if c.get("resident_bits") else "")
    return (
        f"| {name} | {c['concurrency']} | {dtype} | {c['budget_fraction']:.0%} | {a['tok_s']:.1f} | "
        f"{b['tok_s']:.1f} | **{x['tok_s_batched_over_alone']:.2f}x** | {1e3 * one['token_p50_s']:.1f} | "
        f"{1e3 * b['token_p50_s']:.1f} / {1e3 * b['token_p90_s']:.1f} / {1e3 * b['token_p99_s']:.1f} | "
        f"**{x['token_p50_batched_over_single']:.2f}x** | {1e3 * a['ttft_p50_s']:.0f} / {1e3 * b['ttft_p50_s']:.0f}"
        f" | {a['bytes_per_token'] / 1e3:.0f} / {b['bytes_per_token'] / 1e3:.0f} | "
        f"**{x['bytes_per_token_alone_over_batched']:.2f}x** | {r['mean_batch']:.1f} | "
        f"{h['load_average'][0]:.1f} |"
    )


def table(runs: dict[str, dict]) -> str:
    """The side-by-side table of throughput runs (name → JSON of :func:`run`)."""
    head = (
        "| model | N | dtype | budget | alone tok/s | batched tok/s | ratio | single-request p50 ms/token | "
        "batched p50 / p90 / p99 ms/token | p50 ratio | TTFT p50 ms alone / batched | expert KB read per token "
        "alone / batched | bytes ratio | mean batch | load avg |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [table_row(n, r) for n, r in sorted(runs.items())]
    cpus = sorted({r["host"]["cpu"] for r in runs.values()})
    threads = sorted({r["host"]["torch_threads"] for r in runs.values()})
    note = (
        f"\n\nCPU: {', '.join(cpus)}; torch threads {', '.join(map(str, threads))}; medians of "
        f"{', '.join(sorted({str(r['config']['rounds']) for r in runs.values()}))} interleaved rounds; load "
        "average: the 1-minute figure when the run ended (a shared host)."
    )
    return "\n".join([head, *rows]) + note


def publish_table(results_dir: Path = Path("docs/results")) -> str:
    from fate_edge.bench.publish import replace_between_markers, results_file

    runs = {
        p.stem.removeprefix("batching-"): json.loads(p.read_text())
        for p in sorted(results_dir.glob("batching-*.json"))
        if "alone" in json.loads(p.read_text())
    }
    text = table(runs)
    replace_between_markers(results_file("batching"), "batching", text)
    return text


def sweep_table(runs: dict[str, dict]) -> str:
    """Prediction beside measurement per batch size, for each ``--sweep`` run (name → JSON of :func:`sweep`)."""
    lines = [
        "| model | batch | step ms predicted | step ms measured (p50) | decode tok/s predicted | decode tok/s "
        "measured | bound (predicted) | chosen batch | load avg |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in sorted(runs.items()):
        for row in r["rows"]:
            lines.append(
                f"| {name} | {row['batch']} | {1e3 * row['predicted_step_s']:.1f} | "
                f"{1e3 * row['measured_step_p50_s']:.1f} | {row['predicted_decode_tok_s']:.1f} | "
                f"{row['measured_decode_tok_s']:.1f} | {row['bound']} | {r['chosen_batch']} | "
                f"{r['host']['load_average'][0]:.1f} |"
            )
    return "\n".join(lines)


def publish_sweep_table(results_dir: Path = Path("docs/results")) -> str:
    from fate_edge.bench.publish import replace_between_markers, results_file

    runs = {
        p.stem.removeprefix("batching-sweep-"): json.loads(p.read_text())
        for p in sorted(results_dir.glob("batching-sweep-*.json"))
    }
    text = sweep_table(runs)
    replace_between_markers(results_file("batching-sweep"), "batching-sweep", text)
    return text
