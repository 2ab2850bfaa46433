"""Decode tok/s of the bundled model with 0, 1 and 2 competing CPU-bound processes: fate-edge with as many torch
threads as cores and OpenMP waiting by libgomp's default spin, passively (OMP_WAIT_POLICY=PASSIVE) or with a short
spin (GOMP_SPINCOUNT=10000); its library defaults (torch threads + fetch workers = the cores available, the wait
chosen by the load at import); one thread; and llama.cpp on the f32 GGUF with as many threads as cores and with one.
Fresh processes, interleaved rounds, medians; each cell shows the 1-minute load average measured as the run started
(the competitors and other users of the host included).

    python research/bench_threads.py --rounds 3 --json bench-out/threads.json --results
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

from fate_edge.devices.detect import available_cores

from fate_edge import bundled_model_dir
from fate_edge.apps.engine_args import resolve_store
from fate_edge_lab.bench.gguf import PeerUnavailableError, ensure_ggufs
from fate_edge_lab.bench.publish import publish
from fate_edge_lab.bench.threads import configs, prompt_ids, run, summarize, table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--competitors", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--max-s", type=float, default=20.0, help="stop a decode after this long (collapsed runs)")
    ap.add_argument("--memory-budget", default="256MB")
    ap.add_argument("--json", type=Path, default=Path("bench-out/threads.json"))
    ap.add_argument(
        "--results",
        nargs="?",
        const=True,
        default=None,
        type=Path,
        metavar="FILE",
        help="rewrite the table between the bench_threads markers of FILE (without FILE: "
        "docs/results/bench_threads.md)",
    )
    args = ap.parse_args()
    model = bundled_model_dir()
    cores = available_cores()
    cfgs = configs(cores)
    try:
        gguf = str(ensure_ggufs(model, ("f32",))["f32"])
    except PeerUnavailableError as exc:
        print(f"bench_threads: llama.cpp skipped: {exc}", file=sys.stderr)
        gguf, cfgs = "", [c for c in cfgs if c.kind != "llama.cpp"]
    base = {
        "ids": prompt_ids(model, args.prompt_tokens),
        "store": str(resolve_store(model, progress=False)),
        "budget": args.memory_budget,
        "gguf": gguf,
        "decode_tokens": args.decode_tokens,
        "max_s": args.max_s,
    }
    rows = run(base, cfgs, args.competitors, args.rounds)
    summarize(rows)
    import torch

    header = (
        f"Decode tok/s, bundled model, fate-edge int4 experts under its {args.memory_budget} budget (policy "
        f"fate-edge) and llama.cpp f32 resident; {args.prompt_tokens}-token prompt, up to {args.decode_tokens} "
        f"tokens or {args.max_s:.0f} s; median of {args.rounds} interleaved rounds of fresh processes; busy "
        f"processes are `while True: pass` loops; {cores} cores available, {platform.processor() or 'cpu'}, "
        f"torch {torch.__version__} (`research/bench_threads.py`)."
    )
    result = {
        "cores": cores,
        "rounds": args.rounds,
        "competitors": args.competitors,
        "torch": torch.__version__,
        "prompt_tokens": args.prompt_tokens,
        "decode_tokens": args.decode_tokens,
        "rows": rows,
    }
    publish(result, args.json, table(rows, args.competitors, header), args.results, "bench_threads")


if __name__ == "__main__":
    main()
