"""Load time beside llama.cpp: a fate-edge Engine on a store against llama-cpp-python opening the same checkpoint's
GGUF memory-mapped, each in a fresh process (imports counted apart), rounds interleaved, warm or with the page cache
dropped before every load (root).

    python research/load_time.py STORE MODEL.gguf --memory-budget 0.75GB --resident-bits 4 --rounds 3 [--cold]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def child(side: str, target: str, budget: str, resident_bits: int | None, threads: int) -> None:
    t0 = time.perf_counter()
    if side == "fate-edge":
        from fate_edge.runtime.engine import Engine
        from fate_edge.runtime.engine_config import EngineConfig

        t_import = time.perf_counter()
        Engine(EngineConfig(target, budget, "fate-edge", dtype="bfloat16", resident_bits=resident_bits))
    else:
        import llama_cpp

        t_import = time.perf_counter()
        llama_cpp.Llama(model_path=target, n_ctx=256, n_threads=threads, use_mmap=True, verbose=False)
    done = time.perf_counter()
    print(json.dumps({"side": side, "import_s": t_import - t0, "load_s": done - t_import, "total_s": done - t0}))


def drop_page_cache() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store", type=Path)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--memory-budget", default="0.75GB")
    ap.add_argument("--resident-bits", type=int, default=None, choices=[8, 4])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="drop the page cache before every load (needs root)")
    ap.add_argument("--child", nargs=2, metavar=("SIDE", "TARGET"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child, args.memory_budget, args.resident_bits, args.threads)
        return
    rows: dict[str, list[dict]] = {"fate-edge": [], "llama.cpp": []}
    for _ in range(args.rounds):
        for side, target in (("fate-edge", args.store), ("llama.cpp", args.gguf)):
            if args.cold:
                drop_page_cache()
            cmd = [
                sys.executable,
                __file__,
                str(args.store),
                str(args.gguf),
                "--memory-budget",
                args.memory_budget,
                "--threads",
                str(args.threads),
                "--child",
                side,
                str(target),
            ]
            if args.resident_bits:
                cmd += ["--resident-bits", str(args.resident_bits)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            rows[side].append(json.loads(out))
            print(out, flush=True)
    med = {
        side: {k: statistics.median(r[k] for r in rs) for k in ("import_s", "load_s", "total_s")}
        for side, rs in rows.items()
    }
    ratio = med["fate-edge"]["total_s"] / med["llama.cpp"]["total_s"]
    print(json.dumps({"cold": args.cold, "medians": med, "fate_edge_over_llamacpp_total": round(ratio, 2)}))


if __name__ == "__main__":
    main()
