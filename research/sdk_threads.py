"""The SDK's decode speed with ``Engine.load``'s thread default against torch's own default (``threads=None``: every
core, beside the fetch worker), each in fresh processes, alternating (docs/performance.md, "Threads under load").

    python research/sdk_threads.py --rounds 3 [--budget 2MB]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def child(mode: str, budget: str | None) -> None:
    import torch

    from fate_edge import Engine, GenerateConfig

    kw: dict = {"threads": None} if mode == "torch-default" else {}
    if budget:
        kw["memory_budget"] = budget
    with Engine.load(**kw) as engine:
        engine.generate_text("def main():", GenerateConfig(max_tokens=8, ignore_eos=True))  # warm
        rates = []
        for _ in range(3):
            t0, n = time.perf_counter(), 0
            for _ in engine.stream("import os\nimport sys\n", GenerateConfig(max_tokens=64, ignore_eos=True)):
                n += 1
            rates.append(n / (time.perf_counter() - t0))
    print(json.dumps({"mode": mode, "threads": torch.get_num_threads(), "tok_s": statistics.median(rates)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", default=None, help="memory_budget (default: Engine.load's)")
    ap.add_argument("--child", choices=["torch-default", "load-default"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.budget)
        return
    from fate_edge_lab.bench.host import cpu_model, load_average

    runs: dict[str, list[float]] = {"torch-default": [], "load-default": []}
    for _ in range(args.rounds):
        for mode in runs:
            cmd = [sys.executable, __file__, "--child", mode] + (["--budget", args.budget] if args.budget else [])
            line = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            runs[mode].append(json.loads(line)["tok_s"])
    print(json.dumps({"tok_s": runs, "cpu": cpu_model(), "load_average": load_average(), "budget": args.budget}))


if __name__ == "__main__":
    main()
