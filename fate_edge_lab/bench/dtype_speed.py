"""Prefill and decode speed of the compute dtypes on this host, in interleaved rounds (the default dtype's evidence).

One engine per dtype on the same store (every expert fits the budget, so the figures are compute, not reads), each
round running every dtype once in turn; medians over the rounds, with the load average before and after.

    python -m fate_edge_lab.bench.dtype_speed                         # the bundled model
    python -m fate_edge_lab.bench.dtype_speed --model STORE --prompt-tokens 128 --decode-tokens 32 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from fate_edge.apps.command_line import command_parser, positive_int
from fate_edge_lab.bench.host import cpu_model

DTYPES = ("float32", "bfloat16")


def measure(model: str | None, dtypes: tuple[str, ...], prompt_tokens: int, decode_tokens: int, rounds: int) -> dict:
    from fate_edge.bundled import bundled_model_dir
    from fate_edge.format.converted_stores import ensure_store
    from fate_edge.format.store import ExpertStore
    from fate_edge.runtime.engine import Engine
    from fate_edge.runtime.engine_config import EngineConfig
    from fate_edge.runtime.generate import GenerateConfig

    load_before = os.getloadavg()
    path = ensure_store(model or bundled_model_dir(), progress=False)
    store = ExpertStore(path)
    # every expert fits (decoded experts may be larger than their blobs: twice the int4 bytes is room enough)
    budget = 2 * len(store.index["moe_layers"]) * store.index["num_experts"] * store.expert_bytes(4) + (64 << 20)
    engines = {d: Engine(EngineConfig(path, budget, dtype=d)) for d in dtypes}
    tok = engines[dtypes[0]].tokenizer
    text = " ".join(["def expert_cache(budget, layers):\n    return [layer for layer in layers]\n"] * 200)
    ids = tok.encode(text)[:prompt_tokens]
    config = GenerateConfig(max_tokens=decode_tokens, ignore_eos=True)
    samples: dict[str, dict[str, list[float]]] = {d: {"prefill": [], "decode": []} for d in dtypes}
    for e in engines.values():  # warm up: first-call allocations, page cache
        e.complete(ids[:16], GenerateConfig(max_tokens=4, ignore_eos=True))
    for _ in range(rounds):
        for d in dtypes:
            c = engines[d].complete(ids, config)
            samples[d]["prefill"].append(c.prompt_tps)
            samples[d]["decode"].append(c.generation_tps)
    for e in engines.values():
        e.close()
    return {
        "model": str(model or "bundled"),
        "cpu": cpu_model(),
        "threads": __import__("torch").get_num_threads(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "prompt_tokens": len(ids),
        "decode_tokens": decode_tokens,
        "rounds": rounds,
        "median": {d: {k: statistics.median(v) for k, v in s.items()} for d, s in samples.items()},
        "samples": samples,
    }


def render(r: dict) -> str:
    base = r["median"][DTYPES[0]]
    lines = [
        f"{r['model']}: {r['cpu']}, {r['threads']} threads, {r['prompt_tokens']}-token prompt, "
        f"{r['decode_tokens']} decoded, median of {r['rounds']} interleaved rounds, load average "
        f"{r['loadavg_before'][0]:.2f} before / {r['loadavg_after'][0]:.2f} after",
        "",
        "| dtype | prefill tok/s | decode tok/s | decode vs float32 |",
        "|---|---:|---:|---:|",
    ]
    for d, m in r["median"].items():
        lines.append(f"| {d} | {m['prefill']:.1f} | {m['decode']:.1f} | {m['decode'] / base['decode']:.2f}x |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = command_parser("dtype_speed", __doc__)
    ap.add_argument("--model", default=None, help="model or store (default: the bundled model)")
    ap.add_argument("--prompt-tokens", type=positive_int, default=256)
    ap.add_argument("--decode-tokens", type=positive_int, default=64)
    ap.add_argument("--rounds", type=positive_int, default=5)
    ap.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: the CLI's)")
    ap.add_argument("--json", type=Path, default=None)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from fate_edge import defaults

    __import__("torch").set_num_threads(args.threads or defaults.STREAMING_THREADS)
    r = measure(args.model, DTYPES, args.prompt_tokens, args.decode_tokens, args.rounds)
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))
    print(render(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
