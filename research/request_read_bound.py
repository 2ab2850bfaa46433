"""One request under an expert budget: its decode's expert reads beside the fewest any cache could make on the same
routing (Belady-MIN on the calls the engine made, ``fate_edge_lab.bounds.read_bound``), and the decode tokens/s those
reads alone would allow at a read bandwidth. Run on the GPU benchmark's setting (the 8-layer Qwen1.5-MoE slice, its
128-token prompt, 64 greedy tokens, ``scripts/gpu_bench.py``) it says whether a budget's decode target is within
reach of any cache on a link of that bandwidth (docs/gpu.md, "What is not met yet").

    fate-edge synth --like qwen1.5-moe-a2.7b --layers 8 /tmp/qwen8
    fate-edge convert /tmp/qwen8 /tmp/qwen8-store --bits 4 --no-bf16
    python research/request_read_bound.py --store /tmp/qwen8-store --budgets 1GB 0.5GB --read-gbps 2

The engine serves a short warm-up request first, as the GPU benchmark does. Belady replays the measured request's
decode calls from a cache filled beforehand, at no cost, with the best experts to hold (``fewest_reads_warm``):
no cache, warm or preloaded, reads fewer. "cache room" is what the
engine's cache gets of the budget (less its read buffers); "whole budget" takes the budget as cache.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch

from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge.runtime.generate import GenerateConfig
from fate_edge_lab.bench.throughput import host_note
from fate_edge_lab.bounds.read_bound import decode_reads

_spec = importlib.util.spec_from_file_location("gpu_bench", Path(__file__).parents[1] / "scripts" / "gpu_bench.py")
assert _spec is not None and _spec.loader is not None
gpu_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_bench)  # its prompt ids: the request this script reproduces


def measure(args: argparse.Namespace, budget: str) -> dict:
    with Engine(
        EngineConfig(args.store, budget, args.policy, dtype=args.dtype, device=args.device, max_batch=1)
    ) as engine:
        prompt = gpu_bench.prompt_ids(engine.model.config.vocab_size, args.prompt_tokens)
        engine.generate_text(prompt[:16], GenerateConfig(max_tokens=4, ignore_eos=True))  # warm-up, as gpu_bench
        cfg = GenerateConfig(max_tokens=args.decode_tokens, ignore_eos=True)
        _, row = decode_reads(engine, engine.stream(prompt, cfg))
    row["budget"] = budget
    if args.read_gbps:
        per_s = args.read_gbps * 1e9 / row["expert_bytes"]  # experts a second the link reads
        fewest, reads = row["fewest_reads_per_token"]["cache_room"], row["engine_reads_per_token"]
        row["decode_tok_s_cap"] = {
            "engine": per_s / reads if reads else None,
            "fewest": per_s / fewest if fewest else None,
        }
    return row


def _rate(tok_s: float | None) -> str:
    return "no cap (no reads)" if tok_s is None else f"{tok_s:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True)
    ap.add_argument("--budgets", nargs="+", default=["1GB", "0.5GB"])
    ap.add_argument("--policy", default="fate-edge")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--read-gbps", type=float, default=None, help="read bandwidth (GB/s) to turn reads into a cap")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [measure(args, b) for b in args.budgets]
    gbps = f" at {args.read_gbps:g} GB/s" if args.read_gbps else ""
    print(
        f"| budget (experts: cache room / budget / all) | hit rate | reads a decode token: engine | Belady, cache room "
        f"| Belady, whole budget |{' decode tok/s the reads cap' + gbps + ': engine / Belady (room) |' if gbps else ''}"
    )
    print("|---|---:|---:|---:|---:|" + ("---:|" if gbps else ""))
    for r in rows:
        x, b = r["experts"], r["fewest_reads_per_token"]
        line = (
            f"| {r['budget']} ({x['cache_room']} / {x['whole_budget']} / {x['all']}) | {r['hit_rate']:.1%} "
            f"| {r['engine_reads_per_token']:.2f} | {b['cache_room']:.2f} | {b['whole_budget']:.2f} |"
        )
        if gbps:
            line += f" {_rate(r['decode_tok_s_cap']['engine'])} / {_rate(r['decode_tok_s_cap']['fewest'])} |"
        print(line)
    if args.out is not None:
        args.out.write_text(json.dumps({"runs": rows, "host": host_note(args.device)}, indent=1) + "\n")


if __name__ == "__main__":
    main()
