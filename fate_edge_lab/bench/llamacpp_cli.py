"""fate-edge beside llama.cpp on the same checkpoint: the same held-out Python prompt token ids, greedy decode,
the same thread count, fresh processes in interleaved rounds, medians (fate_edge_lab.bench.sidebyside).

Resident: fate-edge fp32 / bf16 / int4 experts vs llama.cpp f32 / bf16 / q4_0 GGUFs (converted from the
checkpoint by llama.cpp's own converter, cached in ~/.cache/fate-edge-peers; fate_edge_lab.bench.gguf).
Memory-limited: fate-edge with an expert budget vs llama.cpp q4_0 memory-mapped in a memory cgroup capped at
fate-edge's peak RSS, page cache dropped first; MB read per decoded token from /proc/PID/io.
A bf16 checkpoint (the real-size synthetic ones) runs the ``real`` sides: bf16 vs bf16, and int4 experts with
bf16 / int8 / int4 resident weights vs q4_0 (no f32 GGUF); its table gets its own markers and file,
docs/results/bench_llamacpp-MODEL-Nt.md. The int4-rest sides read the store ``fate-edge run`` converts by default
(a tied embedding table in int4), the others a store keeping bf16 experts and float resident weights; only the
stores the chosen sides read are converted. A side still running at ``--timeout`` is stopped, reported as a row
(the rates it stayed below, the GB it read) and not run again.

    fate-edge bench-llamacpp --rounds 3 --json bench-out/llamacpp.json --results
    fate-edge bench-llamacpp --model /tmp/olmoe-2l --threads 1 --results

Needs llama-cpp-python (scripts/install_llamacpp.sh in a source checkout).
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from fate_edge.apps.command_line import (
    command_parser,
    fraction,
    model_path,
    positive_float,
    positive_int,
    table_name,
)
from fate_edge.bundled import bundled_model_dir
from fate_edge.corpus import heldout_source
from fate_edge.format.converted_stores import ensure_store
from fate_edge.tokenizer import Tokenizer
from fate_edge_lab.bench.config import HEADLINE_BUDGET
from fate_edge_lab.bench.gguf import ensure_ggufs
from fate_edge_lab.bench.host import cpu_flags, cpu_label, cpu_model, kernel_paths, load_average
from fate_edge_lab.bench.prepare import store_info
from fate_edge_lab.bench.publish import add_results_arg, publish, results_file
from fate_edge_lab.bench.sidebyside import (
    SIDE_SETS,
    add_markers,
    only_sides,
    pick_side_set,
    readme_marker,
    run_rounds,
    same_tokens,
    side_stores,
    summarize,
)
from fate_edge_lab.synthetic.presets import PRESETS

SIDE_NAMES = sorted({side.name for s in SIDE_SETS.values() for side in s.resident + s.limited})


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(summary: dict, header: str) -> str:
    out = [
        header,
        "",
        "| side | experts | rest | prefill tok/s | ratio | decode tok/s | ratio | decode tok / CPU s | ratio "
        "| peak RSS MB | MB read / token |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in summary.items():
        if r.get("unfinished"):
            out.append(_unfinished_row(name, r))
            continue
        rss = None if r["peak_rss_bytes"] is None else r["peak_rss_bytes"] / 1e6
        fail = f" ({r['failed']} of {r['runs']} failed: {'; '.join(r['errors'])[:120]})" if r["failed"] else ""
        out.append(
            f"| {name}{fail} | {r['experts']} | {r['rest']} | {_fmt(r['prefill_tps'], '.0f')} "
            f"| {_ratio(r, 'prefill_tps')} | {_fmt(r['decode_tps'], '.1f')} "
            f"| {_ratio(r, 'decode_tps')} | {_fmt(r.get('decode_cpu_tps'), '.1f')} "
            f"| {_fmt(r.get('decode_cpu_tps_ratio'), '.2f')} | {_fmt(rss, '.0f')} "
            f"| {_fmt(r['decode_read_mb_per_token'], '.2f')} |"
        )
    return "\n".join(out)


def _ratio(row: dict, key: str) -> str:
    """The ratio cell: the ratio, or ``> x`` against a side that did not finish (a bound, not a figure)."""
    if row.get(f"{key}_ratio") is not None:
        return format(row[f"{key}_ratio"], ".2f")
    above = row.get(f"{key}_ratio_above")
    return "-" if above is None else f"> {above:.3g}"


def _unfinished_row(name: str, r: dict) -> str:
    """A side stopped at the timeout, as the measured result it is: the rates it stayed below, what it read."""
    u = r["unfinished"]
    got = (
        "prefill not done"
        if u["tokens"] == 0
        else "load not done"
        if u["tokens"] is None
        else f"{max(u['tokens'] - 1, 0)} of {u['want'] - 1} decode tokens"
    )
    read = "-" if u["read_gb"] is None else f"{u['read_gb']:.1f} GB in {u['after_s']:.0f} s"
    prefill = u.get("prefill_tps")
    return (
        f"| {name} (did not finish in {u['after_s']:.0f} s: {got}; stopped, not run again) | {r['experts']} "
        f"| {r['rest']} | {_fmt(prefill, '.0f') if prefill else _below(u.get('prefill_tps_below'))} | - "
        f"| {_below(u.get('decode_tps_below'))} | - | - | - | - | {read} |"
    )


def _below(v: float | None) -> str:
    return "-" if v is None else f"< {v:.2g}"


def model_label(model: str) -> str:
    """The model's name, and for a synthetic checkpoint its shape and layers (synthetic.json)."""
    path = Path(model)
    label = f"`{path.name}`"
    if (path / "synthetic.json").exists():
        syn = json.loads((path / "synthetic.json").read_text())
        opts = syn.get("options", {})
        preset = PRESETS.get(syn.get("like", ""))
        total = preset.config["num_hidden_layers"] if preset else "?"
        scale = f", widths / {opts['scale']}" if opts.get("scale", 1) != 1 else ""
        label += (
            f" (synthetic {syn.get('like')} shape{scale}, {opts.get('layers') or total} of {total} layers, "
            "random weights)"
        )
    return label


def build_parser() -> argparse.ArgumentParser:
    ap = command_parser("bench-llamacpp", __doc__)
    ap.add_argument(
        "--model",
        default=str(bundled_model_dir()),
        type=model_path,
        help="Hugging Face model directory (default: the bundled model)",
    )
    ap.add_argument("--rounds", type=positive_int, default=3)
    ap.add_argument("--prompt-tokens", type=positive_int, default=128)
    ap.add_argument("--decode-tokens", type=positive_int, default=128)
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--budget", type=fraction, default=HEADLINE_BUDGET, help="expert budget, share of int4 experts")
    ap.add_argument("--no-limited", action="store_true", help="skip the memory-limited mode")
    ap.add_argument(
        "--sides",
        choices=["auto", *SIDE_SETS],
        default="auto",
        help="small: fp32/bf16/int4 vs f32/bf16/q4_0; real: bf16 and int4 experts with bf16/int8/int4 "
        "rest vs bf16/q4_0; mxfp4: gpt-oss's MXFP4 experts kept on both sides; auto: mxfp4 for a checkpoint with "
        "MXFP4 experts, real for a bf16 checkpoint",
    )
    ap.add_argument(
        "--compile",
        choices=["auto", "on", "off"],
        default="off",
        help="fate-edge's fully resident sides decode through one torch.compile'd graph per token "
        "(compiled at load, before timing; default off)",
    )
    ap.add_argument(
        "--side",
        action="append",
        default=None,
        choices=SIDE_NAMES,
        metavar="NAME",
        help="run only this side (repeatable; e.g. --side 'fate-edge int4, int4 rest' --side "
        "'llama.cpp q4_0'): only the GGUFs those sides need are built, and the "
        "table says which ran",
    )
    ap.add_argument("--timeout", type=positive_float, default=900.0, help="per process, seconds")
    ap.add_argument("--json", type=Path, default=Path("bench-out/llamacpp.json"))
    ap.add_argument(
        "--label",
        type=table_name,
        default=None,
        metavar="NAME",
        help="the table's name: its markers and docs/results/NAME.md (default: bench_llamacpp for the bundled "
        "model at 2 threads, else bench_llamacpp-MODEL-Nt); for runs that would otherwise share one, e.g. a "
        "longer --prompt-tokens",
    )
    add_results_arg(
        ap,
        "rewrite the table between its markers (see --label) of FILE (without FILE: "
        "docs/results/NAME.md, created if missing)",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        sides_set = pick_side_set(args.sides, args.model)
    except ValueError as exc:
        ap.error(f"argument --sides: {exc}")
    if args.side:
        try:
            sides_set = only_sides(sides_set, args.side)
        except ValueError as exc:
            ap.error(f"argument --side: {exc}")
    ggufs = {k: str(p) for k, p in ensure_ggufs(args.model, sides_set.gguf_types).items()}  # PeerUnavailableError
    sides = sides_set.resident + ([] if args.no_limited else sides_set.limited)
    # the baselines' store (bf16 experts, float resident weights quantized at load as a side asks) and the lean one
    # a user's `fate-edge run` converts, each only where a side reads it
    stores = side_stores(args.model, sides)
    info = store_info(next(iter(stores.values()), None) or ensure_store(args.model, progress=False))
    tok = Tokenizer(args.model)
    text, files = heldout_source(args.prompt_tokens * 16)
    text_ids = tok.encode(text)
    ids = text_ids[: args.prompt_tokens]
    budget = max(int(args.budget * info["int4_expert_bytes_total"]), 1)
    base = {
        "model": str(Path(args.model).resolve()),
        "ids": ids,
        "text": text,
        "text_ids": text_ids,
        "threads": args.threads,
        "workers": 1,
        "decode_tokens": args.decode_tokens,
        "budget": budget,
        "compile": args.compile,
    }
    load_before = load_average()
    runs, notes = run_rounds(base, sides, ggufs, args.rounds, args.timeout, stores)
    load_after = load_average()
    summary = summarize(runs, sides, sides_set.pairs)
    agree = {f"{a} vs {b}": same_tokens(runs, a, b) for a, b in sides_set.pairs}
    tokenization = next((r["tokenization"] for rs in runs.values() for r in rs if "tokenization" in r), None)
    cpu = cpu_model() or platform.processor()
    label = cpu_label() if cpu_model() else cpu
    paths = kernel_paths()
    header = (
        ("Only the sides named with `--side` ran. " if args.side else "")
        + f"{model_label(args.model)}, {len(ids)}-token held-out Python prompt (same token ids on both sides), "
        f"{args.decode_tokens} greedy decode tokens, {args.threads} threads, median of {args.rounds} "
        f"interleaved rounds of fresh processes; {label}, torch {torch.__version__}, llama-cpp-python "
        f"{__import__('llama_cpp').__version__}; kernels: fate-edge {paths['fate-edge']}, llama.cpp built for "
        f"{paths['llama.cpp']}; load average {load_before[0]} before, {load_after[0]} after, "
        f"per run in the JSON. Ratios: fate-edge / llama.cpp; per CPU s: decode tokens over the process's "
        "CPU time (on a shared host wall time counts waits for a core; at more threads spin-waits count as CPU time). "
        + (
            "fate-edge's resident sides decode through torch.compile (`--compile "
            f"{args.compile}`, compiled at load, before timing). "
            if args.compile != "off"
            else ""
        )
        + (
            ""
            if args.no_limited
            else f"Expert budget {budget / 1e6:.1f} MB ({args.budget:.0%} of int4 "
            f"experts); llama.cpp's cap: {notes.get('cgroup', 'none')}; {notes.get('page_cache', '')}. "
        )
        + "Leading greedy tokens equal: "
        + ", ".join(f"{k}: {v}" for k, v in agree.items() if v is not None)
        + f"; llama.cpp tokenizes the prompt text as fate-edge does: "
        f"{tokenization['equal'] if tokenization else 'not checked'} (`fate-edge bench-llamacpp`)."
    )
    result = {
        "model": args.model,
        "ggufs": ggufs,
        "stores": {k: str(p) for k, p in stores.items()},
        "prompt_files": files,
        "threads": args.threads,
        "rounds": args.rounds,
        "cpu": cpu,
        "cpu_flags": cpu_flags(),
        "kernels": paths,
        "torch": torch.__version__,
        "load_avg_before": load_before,
        "load_avg_after": load_after,
        "notes": notes,
        "summary": summary,
        "token_agreement": agree,
        "tokenization": tokenization,
        "runs": runs,
    }
    marker = args.label or readme_marker(args.model, args.threads)
    results = results_file(marker) if args.results is True else Path(args.results) if args.results else None
    if results:
        add_markers(results, marker)
    publish(result, args.json, table(summary, header), results, marker)
    return 0
