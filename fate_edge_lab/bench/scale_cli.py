"""fate-edge at a real model's size: convert a full-size checkpoint in a 2 GB memory cgroup, then run it at 2 GB
and 4 GB expert budgets from the raw disk (page cache dropped), each run confined by a memory cgroup to what
fate-edge says it needs (resident weights + budget + runtime baseline). Needs root (cgroups, drop_caches).

    fate-edge synth --like qwen1.5-moe-a2.7b /data/qwen-moe     # 28.6 GB bf16
    fate-edge bench-scale /data/qwen-moe /data/qwen-moe-store --out results/scale

Writes ``scale.json`` and ``scale.md`` (a markdown table) under --out; with --results, also the table between
the ``<!-- MARK:begin -->`` / ``<!-- MARK:end -->`` markers of docs/results/MARK.md (--mark, default scale).
The measuring is fate_edge_lab.bench.scale's; this module is its command line and its tables.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from fate_edge.apps.command_line import (
    command_parser,
    existing_path_as_path,
    model_path_as_path,
    non_empty,
    positive_float,
    positive_int,
)
from fate_edge.format.convert import ConvertOptions
from fate_edge.runtime.policy import PRESETS
from fate_edge_lab.bench.gguf import q4_0_direct
from fate_edge_lab.bench.publish import add_results_arg, publish
from fate_edge_lab.bench.scale import GB, ScaleConfig, run_scale

GGUF_NOTE = (
    "converter from the checkpoint with its matrices Q4_0 and the output bf16, then "
    "llama_model_quantize Q4_0: output q6_K, the rest copied; routers and norms f32"
)


def _precisions(opts: dict) -> str:
    kept = [f"int{opts['bits']}"] + ([f"int{opts['cold_bits']}"] if opts["cold_bits"] else [])
    return " + ".join(kept + (["bf16"] if opts["keep_bf16"] else [])) + f" experts, {opts['method']}"


def _cap(cfg: dict) -> str:
    if cfg.get("cap_bytes"):
        return f"{cfg['cap_bytes'] / GB:.2f} GB for both sides"
    return "what fate-edge was given (its memory_need)"


def table(result: dict) -> str:
    cfg = result["config"]
    lines = []
    if "convert" in result:
        c, d, e = result["convert"], result["disk"], result["encoder"]
        if "error" in c:
            lines.append(f"Convert failed: {c['error']}")
        else:
            lines += [
                f"Convert ({_precisions(cfg['convert_opts'])}): "
                f"{c['source_bytes'] / GB:.1f} GB bf16 in {c['seconds']:.0f} s = **{c['gb_per_s']:.3f} GB/s**, "
                f"peak RSS {c['peak_rss_bytes'] / GB:.2f} GB inside a {c['limit_bytes'] / GB:.0f} GB memory cgroup "
                f"(cgroup peak {c.get('peak_bytes', 0) / GB:.2f} GB with page cache, OOM kills: {c.get('oom_kills')}); "
                f"load average {c['load_before'][0]:.1f} → {c['load_after'][0]:.1f} on {result['cpus']} CPUs.",
                f"Bounds: disk write {d['write_gb_per_s']:.2f} GB/s, cold read {d['read_gb_per_s']:.2f} GB/s; the "
                f"encoder alone {e['gb_per_s']:.3f} GB/s on {e['threads']} threads (load {e['load'][0]:.1f}).",
                "",
            ]
    lines += [
        f"| expert budget | cgroup cap | prefill tok/s ({cfg['prompt_tokens']} tok) | decode tok/s | "
        "decode hit rate | MB read / token | peak RSS | resident + budget + baseline | OOM kills | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        need = r["need"]
        parts = (
            f"{need['resident_bytes'] / GB:.2f} + {need['budget_bytes'] / GB:g} + {need['baseline_bytes'] / GB:.2f} GB"
        )
        if "error" in r:
            lines.append(
                f"| {r['budget_bytes'] / GB:g} GB | {r['limit_bytes'] / GB:.2f} GB | {r['error']} | | | | "
                f"| {parts} | {r.get('oom_kills')} | {r['load_before'][0]:.1f} |"
            )
            continue
        lines.append(
            f"| {r['budget_bytes'] / GB:g} GB | {r['limit_bytes'] / GB:.2f} GB | {r['prefill_tps']:.2f} | "
            f"{r['decode_tps']:.2f} | {r['decode_hit_rate']:.1%} | {r['decode_mb_read_per_token']:.1f} | "
            f"{r['peak_rss_bytes'] / GB:.2f} GB | {parts} (baseline measured: {r['baseline_rss_bytes'] / GB:.2f}) | "
            f"{r.get('oom_kills')} | {r['load_before'][0]:.1f} → {r['load_after'][0]:.1f} |"
        )
    lines.append("")
    rest = f"int{cfg['resident_bits']}" if cfg.get("resident_bits") else cfg["dtype"]
    lines.append(
        f"Policy {cfg['policy']}, {rest} resident weights (embeddings {_embeddings(result)}), {cfg['threads']} torch "
        f"threads, {cfg['decode_tokens']} decoded tokens, page cache dropped before each run, O_DIRECT reads."
    )
    if result.get("llama"):
        lines += ["", *side_by_side(result)]
    return "\n".join(lines)


# fate-edge's decode against llama.cpp's when both are capped at 0.75 of llama.cpp's file (docs/memory.md)
DECODE_TARGET = 3.0


def _embeddings(result: dict) -> str:
    bits = result.get("store_embedding_bits")
    return f"int{bits}, read by row from the store" if bits else result["config"]["dtype"]


def _gb(x) -> str:
    return "–" if x is None else f"{x / GB:.2f} GB"


def _num(x, fmt: str = ".2f") -> str:
    return "–" if x is None else format(x, fmt)


def side_by_side(result: dict) -> list[str]:
    """fate-edge beside llama.cpp q4_0 memory-mapped under the same cgroup cap, medians per budget."""
    cfg = result["config"]
    lines = [
        "| expert budget | cgroup cap (both) | side | prefill tok/s | decode tok/s | decode x llama.cpp | "
        "MB read / token | peak RSS | cgroup peak | OOM kills | runs (failed) | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for row in result["summary"]:
        b = row["budget_bytes"]
        for name, s in row["sides"].items():
            ratio = s.get("decode_tps_ratio")
            lines.append(
                f"| {b / GB:g} GB | {_gb(s['limit_bytes'])} | {name} | {_num(s['prefill_tps'])} | "
                f"{_num(s['decode_tps'])} | {_num(ratio) + 'x' if ratio else ''} | "
                f"{_num(s['decode_read_mb_per_token'], '.1f')} | {_gb(s['peak_rss_bytes'])} | "
                f"{_gb(s['cgroup_peak_bytes'])} | {s['oom_kills']} | {s['runs']} ({s['failed']}) | "
                f"{_num(s['load_avg'], '.1f')} |"
            )
        ratio = row["sides"]["fate-edge"].get("decode_tps_ratio")
        verdicts.append(
            f"{b / GB:g} GB: "
            + (
                "no llama.cpp figure"
                if ratio is None
                else f"{ratio:.2f}x ({'met' if ratio >= DECODE_TARGET else 'missed'})"
            )
        )
    rest = f"int{cfg['resident_bits']}" if cfg.get("resident_bits") else cfg["dtype"]
    lines += [
        "",
        f"fate-edge: int4 experts streamed (O_DIRECT), {rest} attention/shared experts/lm_head, "
        f"embeddings {_embeddings(result)}; llama.cpp: q4_0 mix ({result.get('gguf_note', 'q4_0 GGUF')}), "
        f"memory-mapped{'' if cfg.get('llama_repack') else ' (Q4_0 repack off, as --no-repack)'}, in a memory "
        f"cgroup capped at {_cap(cfg)}; "
        f"{cfg['threads']} thread(s) each on {result.get('cpus', '?')} CPUs ({result.get('cpu_model') or '?'}), "
        f"{cfg['prompt_tokens']} prompt ids shared, {cfg['decode_tokens']} "
        f"decoded tokens, page cache dropped before every run, {cfg['rounds']} interleaved round(s), medians.",
        f"Target decode >= {DECODE_TARGET:g}x llama.cpp: " + "; ".join(verdicts) + ".",
        "",
    ]
    lines += [
        f"fate-edge decode time per token at {b / GB:g} GB (medians): {split}"
        for b, split in time_split(result.get("runs", [])).items()
    ]
    return lines


def time_split(runs: list[dict]) -> dict[int, str]:
    """Per budget, a decoded token's time split by the engine's own counters: waiting for expert reads (stall),
    turning fetched bytes into experts (consume), predicting and issuing prefetches, and the rest (the forward
    pass's compute and Python)."""
    from statistics import median

    out = {}
    for b in sorted({r["budget_bytes"] for r in runs}):
        ok = [r for r in runs if r["budget_bytes"] == b and "error" not in r and r.get("decode_tps")]
        if not ok:
            continue
        ms = {
            k: median(r["decode"][k] / r["decode_tokens"] * 1e3 for r in ok)
            for k in ("stall_s", "consume_s", "predict_s")
        }
        total = median(1e3 / r["decode_tps"] for r in ok)
        rest = total - sum(ms.values())
        out[b] = (
            f"{total:.0f} ms = stall on reads {ms['stall_s']:.0f} ({ms['stall_s'] / total:.0%}) + consume "
            f"{ms['consume_s']:.0f} + predict {ms['predict_s']:.0f} + compute and the rest {rest:.0f} "
            f"({rest / total:.0%})"
        )
    return out


def gb_list(value: str) -> list[int]:
    """Command-line type: expert budgets in GB, comma-separated ('': none, convert only), as bytes."""
    try:
        gbs = [float(b) for b in value.split(",") if b.strip()]
    except ValueError:
        gbs = [math.nan]
    if not all(0 < g < math.inf for g in gbs):
        raise argparse.ArgumentTypeError(f"{value!r} is not a list of budgets in GB > 0, e.g. 2,4 ('': convert only)")
    return [int(g * GB) for g in gbs]


def build_parser() -> argparse.ArgumentParser:
    ap = command_parser("bench-scale", __doc__)
    ap.add_argument(
        "model", type=model_path_as_path, help="Hugging Face checkpoint (e.g. a synthetic one at real shapes)"
    )
    ap.add_argument("store", type=Path, help="expert store to write (or to use, with --no-convert)")
    ap.add_argument("--out", type=Path, default=Path("results/scale"))
    ap.add_argument(
        "--budgets",
        type=gb_list,
        default="2,4",
        help="expert budgets in GB, comma-separated (default 2,4; '': convert only)",
    )
    ap.add_argument("--no-convert", action="store_true", help="use the existing store")
    ap.add_argument("--convert-limit-gb", type=positive_float, default=2.0)
    ap.add_argument(
        "--bits", type=int, default=4, choices=(8, 4, 3, 2), help="precision of the streamed experts (default 4)"
    )
    ap.add_argument("--cold-bits", type=int, default=None, choices=(4, 3, 2), help="also write a low-precision copy")
    ap.add_argument("--keep-bf16", action="store_true", help="also write bf16 experts (+25 GB at Qwen1.5-MoE size)")
    ap.add_argument(
        "--policy",
        default="fate-edge",
        choices=list(PRESETS),
        metavar="POLICY",
        help=f"policy preset: {', '.join(PRESETS)} (default fate-edge)",
    )
    ap.add_argument("--prompt-tokens", type=positive_int, default=64)
    ap.add_argument("--decode-tokens", type=positive_int, default=16)
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument(
        "--resident-bits",
        type=int,
        default=None,
        choices=(8, 4),
        help="quantize attention, shared experts and lm_head at load (llama.cpp's q4_0 mix does too)",
    )
    ap.add_argument(
        "--gguf",
        type=Path,
        default=None,
        help="llama.cpp q4_0 GGUF of the same checkpoint, run memory-mapped beside each budget under "
        "the same cap (made from MODEL by gguf.q4_0_direct when missing)",
    )
    ap.add_argument(
        "--llama-repack",
        action="store_true",
        help="leave llama.cpp's Q4_0 repack on (it copies the weights into RAM: not memory-mapped)",
    )
    ap.add_argument("--rounds", type=positive_int, default=1, help="interleaved rounds (medians over them)")
    ap.add_argument(
        "--cap-gb",
        type=positive_float,
        default=None,
        help="one memory cgroup cap for both sides (default: what fate-edge says it needs)",
    )
    ap.add_argument(
        "--convert-from",
        type=existing_path_as_path,
        default=None,
        help="with --no-convert: the scale.json of an earlier convert-only run (--budgets ''), whose "
        "convert figures the table keeps",
    )
    ap.add_argument(
        "--timeout", type=positive_float, default=3600.0, help="seconds one run may take (then: an error row)"
    )
    add_results_arg(ap, "also write the table between the MARK markers of FILE (without FILE: docs/results/MARK.md)")
    ap.add_argument(
        "--mark", default="scale", type=non_empty, help="the table's markers (e.g. scale-2t for a 2-thread run)"
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = ScaleConfig(
        args.model,
        args.store,
        args.budgets,
        not args.no_convert,
        int(args.convert_limit_gb * GB),
        # resident weights as in the checkpoint: --resident-bits quantizes them at load
        ConvertOptions(
            bits=args.bits, cold_bits=args.cold_bits, keep_bf16=args.keep_bf16, resident_bits=None, embedding_bits=None
        ),
        args.policy,
        prompt_tokens=args.prompt_tokens,
        decode_tokens=args.decode_tokens,
        threads=args.threads,
        resident_bits=args.resident_bits,
        gguf=args.gguf,
        rounds=args.rounds,
        timeout_s=args.timeout,
        llama_repack=args.llama_repack,
        cap_bytes=int(args.cap_gb * GB) if args.cap_gb else None,
    )
    if args.gguf is not None and not args.gguf.exists():
        q4_0_direct(args.model, args.gguf, quiet=False)
    result = run_scale(cfg, args.out)
    if args.gguf is not None:
        result["gguf_note"] = GGUF_NOTE
    if args.convert_from is not None:
        earlier = json.loads(args.convert_from.read_text())
        result.update({k: earlier[k] for k in ("convert", "disk", "encoder") if k in earlier})
    text = table(result)
    (args.out / "scale.md").write_text(text + "\n")
    publish(result, args.out / "scale.json", text, args.results, args.mark)
    return 0
