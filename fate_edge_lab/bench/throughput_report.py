"""The throughput mode's tables (``python -m fate_edge_lab.bench.throughput --publish``): its runs side by side in
docs/results/batching.md, its ``--emulate`` runs in docs/results/batching-emulated.md, and its ``--sweep`` runs (the
batch-size roofline beside measurement) in docs/results/batching-sweep.md, each rebuilt from every run's JSON in
docs/results."""

from __future__ import annotations

import json
from pathlib import Path

from fate_edge_lab.bench.throughput_rounds import ratio_text


def host_cell(h: dict) -> str:
    """A row's host: its CPU and torch threads (rows measured on different hosts share a table)."""
    return f"{h['cpu']}, {h['torch_threads']} torch thread" + ("" if h["torch_threads"] == 1 else "s")


def table_row(name: str, r: dict) -> str:
    a, b, one, x = r["alone"], r["batched"], r["single_request"], r["ratios"]
    c, h = r["config"], r["host"]
    dtype = c["dtype"] + (f", int{c['resident_bits']} resident" if c.get("resident_bits") else "")
    if "gpu" in h:  # a CUDA run (the GPU check's): the row names its GPU
        dtype += f", {h['gpu']}"
    return (
        f"| {name} | {c['concurrency']} | {dtype} | {c['budget_fraction']:.0%} | {a['tok_s']:.1f} | "
        f"{b['tok_s']:.1f} | **{x['tok_s_batched_over_alone']:.2f}x** | {1e3 * one['token_p50_s']:.1f} | "
        f"{1e3 * b['token_p50_s']:.1f} / {1e3 * b['token_p90_s']:.1f} / {1e3 * b['token_p99_s']:.1f} | "
        f"**{x['token_p50_batched_over_single']:.2f}x** | {1e3 * a['ttft_p50_s']:.0f} / {1e3 * b['ttft_p50_s']:.0f}"
        f" | {a['bytes_per_token'] / 1e3:.0f} / {b['bytes_per_token'] / 1e3:.0f} | "
        f"**{ratio_text(x['bytes_per_token_alone_over_batched'])}** | {r['mean_batch']:.1f} | "
        f"{h['load_average'][0]:.1f} | {host_cell(h)} |"
    )


def table(runs: dict[str, dict]) -> str:
    """The side-by-side table of throughput runs (name → JSON of :func:`run`)."""
    head = (
        "| model | N | dtype | budget | alone tok/s | batched tok/s | ratio | single-request p50 ms/token | "
        "batched p50 / p90 / p99 ms/token | p50 ratio | TTFT p50 ms alone / batched | expert KB read per token "
        "alone / batched | bytes ratio | mean batch | load avg | CPU, threads |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [table_row(n, r) for n, r in sorted(runs.items())]
    return "\n".join([head, *rows]) + "\n\n" + _how(runs, "CPU")


def _how(runs: dict[str, dict], host: str) -> str:
    """The table's footnote: the hosts, threads and rounds of its runs."""
    cpus = sorted({r["host"]["cpu"] for r in runs.values()})
    threads = sorted({r["host"]["torch_threads"] for r in runs.values()})
    return (
        f"{host}: {', '.join(cpus)}; torch threads {', '.join(map(str, threads))}; medians of "
        f"{', '.join(sorted({str(r['config']['rounds']) for r in runs.values()}))} interleaved rounds; load "
        "average: the 1-minute figure when the run ended (a shared host)."
    )


def publish_table(results_dir: Path = Path("docs/results")) -> str:
    from fate_edge_lab.bench.publish import replace_between_markers, results_file

    runs = {
        p.stem.removeprefix("batching-"): json.loads(p.read_text())
        for p in sorted(results_dir.glob("batching-*.json"))
        if "alone" in (r := json.loads(p.read_text())) and "emulation" not in r
    }
    text = table(runs)
    replace_between_markers(results_file("batching"), "batching", text)
    return text


def emulated_row(name: str, r: dict) -> str:
    a, b, one, x, em = r["alone"], r["batched"], r["single_request"], r["ratios"], r["emulation"]
    c, raw = r["config"], r["raw"]

    def stall(mode: dict) -> str:
        return f"{mode['stall_s_per_token'] * mode['tokens'] / mode['wall_s']:.0%}"

    return (
        f"| {name} | {em['profile']} | {c['concurrency']} | {c['budget_fraction']:.0%} | "
        f"{em['alone']['k']:.3g} / {em['batched']['k']:.3g} | {a['tok_s']:.0f} | {b['tok_s']:.0f} | "
        f"**{x['tok_s_batched_over_alone']:.2f}x** | {1e3 * one['token_p50_s']:.2f} | {1e3 * b['token_p50_s']:.2f} | "
        f"**{x['token_p50_batched_over_single']:.2f}x** | {a['bytes_per_token'] / 1e3:.0f} / "
        f"{b['bytes_per_token'] / 1e3:.0f} | **{ratio_text(x['bytes_per_token_alone_over_batched'])}** | "
        f"{em['batched']['union_per_layer']:.1f} | {stall(raw['alone'])} / {stall(raw['batched'])} | "
        f"{r['mean_batch']:.1f} | {r['host']['load_average'][0]:.1f} | {host_cell(r['host'])} |"
    )


def emulated_table(runs: dict[str, dict]) -> str:
    """The side-by-side table of ``--emulate`` runs (name → JSON of ``throughput_emulated.run_emulated``)."""
    head = (
        "| model | device | N | budget | k alone / batched | alone tok/s | batched tok/s | ratio | single-request "
        "p50 ms/token | batched p50 ms/token | p50 ratio | expert KB read per token alone / batched | bytes ratio | "
        "experts a batched layer computes | stall share alone / batched | mean batch | load avg | CPU, threads |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [emulated_row(n, r) for n, r in sorted(runs.items())]
    lead = "Device-equivalent figures (raw x k, latencies / k; each mode with its own k). "
    return "\n".join([head, *rows]) + "\n\n" + lead + _how(runs, "Host")


def publish_emulated_table(results_dir: Path = Path("docs/results")) -> str:
    from fate_edge_lab.bench.publish import replace_between_markers, results_file

    runs = {
        p.stem.removeprefix("batching-emulated-"): json.loads(p.read_text())
        for p in sorted(results_dir.glob("batching-emulated-*.json"))
    }
    text = emulated_table(runs)
    replace_between_markers(results_file("batching-emulated"), "batching-emulated", text)
    return text


def sweep_table(runs: dict[str, dict]) -> str:
    """Prediction beside measurement per batch size, for each ``--sweep`` run (name → JSON of :func:`sweep`)."""
    lines = [
        "| model | batch | step ms predicted | step ms measured (p50) | decode tok/s predicted | decode tok/s "
        "measured | bound (predicted) | chosen batch | load avg | CPU, threads |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in sorted(runs.items()):
        for row in r["rows"]:
            lines.append(
                f"| {name} | {row['batch']} | {1e3 * row['predicted_step_s']:.1f} | "
                f"{1e3 * row['measured_step_p50_s']:.1f} | {row['predicted_decode_tok_s']:.1f} | "
                f"{row['measured_decode_tok_s']:.1f} | {row['bound']} | {r['chosen_batch']} | "
                f"{r['host']['load_average'][0]:.1f} | {host_cell(r['host'])} |"
            )
    return "\n".join(lines)


def publish_sweep_table(results_dir: Path = Path("docs/results")) -> str:
    from fate_edge_lab.bench.publish import replace_between_markers, results_file

    runs = {
        p.stem.removeprefix("batching-sweep-"): json.loads(p.read_text())
        for p in sorted(results_dir.glob("batching-sweep-*.json"))
    }
    text = sweep_table(runs)
    replace_between_markers(results_file("batching-sweep"), "batching-sweep", text)
    return text
