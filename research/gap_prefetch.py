"""Could the second thread stream the next matrix into the caches while the first runs the Python between a decode
token's int4 calls? Builds ``gap_prefetch.c`` beside this file (fate-edge's int4 kernel compiled in) and runs its
synthetic Qwen1.5-MoE decode layers at two threads, in fresh processes, interleaved: the kernel's own OpenMP calls,
a two-thread pool of the probe's own, and that pool with its worker reading the next call's first megabytes during
each gap (plain loads, PREFETCHT0, PREFETCHT2). Prints each variant's median per 8 layers (total, and inside the
calls) with the load average (docs/cpu-profile.md, Zen 5). AVX512-VNNI hosts only.

    python research/gap_prefetch.py --layers 12 --gap-us 60 --prefetch-mb 4 --repeats 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from fate_edge.native_build import CFLAGS, compiler
from fate_edge_lab.bench.host import cpu_model

VARIANTS = {
    "openmp (today)": ["0"],
    "pool": ["1"],
    "pool, loads in the gaps": ["2", "0"],
    "pool, PREFETCHT0 in the gaps": ["2", "1"],
    "pool, PREFETCHT2 in the gaps": ["2", "2"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--gap-us", type=float, default=60.0, help="busy work on the caller before each of 4 calls")
    ap.add_argument("--prefetch-mb", type=float, default=4.0, help="most the worker reads ahead in one gap")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per process (its median is kept)")
    ap.add_argument("--repeats", type=int, default=4, help="fresh processes per variant, interleaved")
    args = ap.parse_args()
    cc = compiler()
    if cc is None:
        raise SystemExit("no C compiler (set CC)")
    root = Path(__file__).resolve().parent.parent
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "gap_prefetch"
        cmd = [cc, *CFLAGS, f"-I{root}", str(Path(__file__).with_suffix(".c")), "-o", str(exe), "-lm", "-lpthread"]
        subprocess.run(cmd, check=True)
        loads = [os.getloadavg()[0]]
        for _ in range(args.repeats):
            for name, extra in VARIANTS.items():
                common = [str(args.layers), str(args.gap_us), str(args.prefetch_mb), str(args.rounds)]
                out = subprocess.run([str(exe), *common, *extra], capture_output=True, text=True, check=True).stdout
                rows = [json.loads(line) for line in out.splitlines()]
                total = statistics.median(r["per_8_layers_ms"] for r in rows)
                inside = statistics.median(r["in_calls_ms"] for r in rows)
                results[name].append((total, inside))
            loads.append(os.getloadavg()[0])
    print(json.dumps({"cpu": cpu_model(), "load_average": [min(loads), max(loads)], **vars(args)}))
    for name, runs in results.items():
        total = statistics.median(t for t, _ in runs)
        inside = statistics.median(i for _, i in runs)
        each = ", ".join(f"{t:.2f}" for t, _ in runs)
        print(f"{name:30s} per 8 layers {total:6.2f} ms (in the calls {inside:5.2f}); each process: {each}")


if __name__ == "__main__":
    main()
