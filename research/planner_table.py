"""The planner (``--policy auto``) against the device's ``fate-edge`` preset, from ``fate-edge bench`` runs.

    fate-edge bench --presets fate-edge --budgets 0.2 0.35 0.5 --emulate orin-nano --prompt-tokens 128 \\
        --decode-tokens 48 --runs 3 --no-peers --out-dir OUT      # and orin-nx, agx-orin, --links raw-disk
    python research/planner_table.py OUT1/bench.json OUT2/bench.json ... --results

One row per (run, budget): the preset measured, ``auto`` measured (the planner runs in the measuring worker, then its
pick is measured at once), their ratio, the planner's predicted decode tok/s for its pick against the pick's
measurement, and its prediction for the preset against the preset's measurement. Medians of the bench's rounds.
Writes docs/results/planner.md between its markers with ``--results``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from fate_edge_lab.bench.publish import add_results_arg, publish
from fate_edge_lab.bench.report import describe_policy


def rows(bench: dict) -> list[dict]:
    em = bench.get("emulation") or {}
    where = f"{em['profile']} emulated (k = {em['dilation_k']:.3g})" if em else "this host, raw disk"
    out = []
    for r in bench["results"]:
        if r["preset"] != "planned" or not r.get("preset_decode_tps"):
            continue
        picks = sorted({describe_policy(p) for p in r.get("planner_policies") or [r.get("policy") or {}]})
        out.append(
            {
                "where": where,
                "budget": r["budget_fraction"],
                "preset": r["preset_decode_tps"],
                "auto": r["median"]["decode_tps"],
                "auto_over_preset": r["auto_over_preset"],
                "predicted": r["planner_predicted_decode_tps"],
                "error": r["planner_error"],
                "preset_predicted": r.get("preset_predicted_decode_tps"),
                "preset_error": r.get("preset_prediction_error"),
                "picks": picks,
                "load": [a[0] for a in r.get("load_averages", [])],
                "date": bench["date"],
                "commit": bench.get("commit"),
            }
        )
    return sorted(out, key=lambda r: r["budget"])


def table(all_rows: list[dict], cpu: str) -> str:
    runs = sorted({f"{r['date'][:16]} (commit {r['commit']})" for r in all_rows})
    lines = [
        f"Runs: {', '.join(runs)}. CPU: {cpu}, 2 torch threads; "
        "raw host decode tok/s (device-equivalent = raw x k), 128-token prompt + 48 "
        "greedy tokens, medians of 3 rounds (each in a fresh process); the planner plans for the measured request.",
        "",
        "| device | budget | `fate-edge` measured | `auto` measured | auto / preset | `auto`'s pick | predicted "
        "for the pick | error | predicted for the preset | error | load (1 min, per round) |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in all_rows:
        pe = "—" if r["preset_error"] is None else f"{100 * r['preset_error']:+.0f}%"
        pp = "—" if r["preset_predicted"] is None else f"{r['preset_predicted']:.1f}"
        lines.append(
            f"| {r['where']} | {100 * r['budget']:.0f}% | {r['preset']:.1f} | {r['auto']:.1f} | "
            f"{r['auto_over_preset']:.2f}x | {', '.join(r['picks'])} | {r['predicted']:.1f} | "
            f"{100 * r['error']:+.0f}% | {pp} | {pe} | {' / '.join(f'{x:.1f}' for x in r['load']) or '—'} |"
        )
    ratios = [r["auto_over_preset"] for r in all_rows]
    errors = [abs(e) for r in all_rows for e in (r["error"], r["preset_error"]) if e is not None]
    lines += [
        "",
        f"auto / preset: {min(ratios):.2f}-{max(ratios):.2f}x, {sum(x >= 0.97 for x in ratios)} of {len(ratios)} rows "
        f">= 0.97x (median {statistics.median(ratios):.2f}x); |prediction error| at most {100 * max(errors):.0f}% "
        f"({sum(e <= 0.15 for e in errors)} of {len(errors)} predictions within 15%).",
    ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench_json", nargs="+", type=Path)
    ap.add_argument("--cpu", default="", help="the CPU model the runs were made on (the bench JSON has no model name)")
    ap.add_argument("--json", default="/tmp/planner_table.json")
    add_results_arg(ap, "write the table into docs/results/planner.md (or FILE) between its markers")
    args = ap.parse_args()
    all_rows = [row for p in args.bench_json for row in rows(json.loads(p.read_text()))]
    if not all_rows:
        raise SystemExit("no planned rows with a fate-edge row beside them in these bench files")
    if not args.cpu:
        from fate_edge_lab.bench.host import cpu_model

        args.cpu = cpu_model()
    publish({"rows": all_rows, "cpu": args.cpu}, args.json, table(all_rows, args.cpu), args.results, "planner")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
