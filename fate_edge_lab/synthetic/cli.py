"""Write a synthetic checkpoint with the published shapes of a real MoE model (random bf16 weights,
trained-like routing), to benchmark fate-edge at real size without downloading the weights.

    fate-edge synth --like qwen1.5-moe-a2.7b --layers 2 /tmp/qwen-moe-2l
    fate-edge synth --like olmoe-1b-7b --scale 16 --measure 512 /tmp/olmoe-small
    fate-edge synth --like gpt-oss-20b --layers 2 --mxfp4 /tmp/gpt-oss-2l   # experts in MXFP4, as published

Presets: qwen1.5-moe-a2.7b, olmoe-1b-7b, deepseek-v2-lite, qwen3-30b-a3b, mixtral-8x7b, glm-4.5-air,
ernie-4.5-21b-a3b, minimax-m2, gpt-oss-20b, qwen3-next-80b-a3b, lfm2-8b-a1b (see fate_edge_lab/synthetic/presets.py
for the configs and their sources). Weights are written streaming: memory stays small whatever the model's size.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from fate_edge.apps.command_line import command_parser, non_negative_int, positive_float, positive_int
from fate_edge_lab.synthetic.build import SyntheticOptions, make_synthetic_model, plan
from fate_edge_lab.synthetic.measure import measure_router_structure
from fate_edge_lab.synthetic.mxfp4_experts import mxfp4_specs
from fate_edge_lab.synthetic.presets import PRESETS
from fate_edge_lab.synthetic.writer import nbytes


def build_parser() -> argparse.ArgumentParser:
    ap = command_parser("synth", __doc__)
    ap.add_argument("out", type=Path, help="the checkpoint's directory")
    ap.add_argument("--like", required=True, choices=sorted(PRESETS), help="the model whose shapes to take")
    ap.add_argument("--layers", type=positive_int, default=None, help="keep the first N layers (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=positive_int, default=1, help="divide every width by this (default 1: real shapes)")
    ap.add_argument("--shard-gb", type=positive_float, default=2.0, help="shard size in GB")
    ap.add_argument("--threads", type=positive_int, default=1, help="torch threads for the random numbers")
    ap.add_argument(
        "--mxfp4",
        action="store_true",
        help="gpt-oss: write the experts in MXFP4 (*_blocks / *_scales and quantization_config), the layout OpenAI "
        "publishes and users download; default: the float (bf16) layout transformers saves after dequantizing",
    )
    ap.add_argument(
        "--measure",
        type=non_negative_int,
        default=0,
        metavar="TOKENS",
        help="afterwards, load the model and report expert-usage entropy and cross-layer gate recall",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    opts = SyntheticOptions(args.like, args.layers, args.seed, args.scale, int(args.shard_gb * 1e9), mxfp4=args.mxfp4)
    try:
        _, specs, _ = plan(opts)
        entries = mxfp4_specs(specs) if args.mxfp4 else specs
    except ValueError as e:
        raise SystemExit(f"fate-edge synth: {e}") from None
    total = sum(nbytes(e, "BF16") for e in entries)
    print(
        f"{args.like}: {len(entries)} tensors, {sum(s.numel for s in specs) / 1e9:.2f} B params, "
        f"{total / 1e9:.2f} GB {'bf16, experts MXFP4' if args.mxfp4 else 'bf16'} -> {args.out}",
        flush=True,
    )
    start, done = time.perf_counter(), [0]

    def progress(spec, nbytes: int) -> None:
        done[0] += nbytes
        if done[0] * 20 // total != (done[0] - nbytes) * 20 // total:
            rate = done[0] / (time.perf_counter() - start) / 1e9
            print(f"  {done[0] / 1e9:6.2f} / {total / 1e9:.2f} GB  {rate:.3f} GB/s", flush=True)

    index = make_synthetic_model(args.out, opts, progress)
    seconds = time.perf_counter() - start
    size = index["metadata"]["total_size"]
    print(f"wrote {size / 1e9:.2f} GB in {seconds:.1f} s ({size / 1e9 / seconds:.3f} GB/s, tokenizer included)")
    if args.measure:
        print(measure_router_structure(args.out, args.measure).summary())
    return 0
