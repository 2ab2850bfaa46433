"""How fast the native int4 kernel streams weights from DRAM at one row (a decode token's matvecs).

Many [N, K] int4 matrices, more than the last-level cache holds, each multiplied once in turn by one bf16 row:
GB/s of int4 codes per second, per thread count, median of ``--runs`` passes. A decode token at real size reads
~1.2 GB this way (Qwen1.5-MoE-A2.7B shape with int4 resident weights), so this bounds its compute time.

    python research/bench_stream.py --matrices 500 --threads 1 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from fate_edge.quant.native import NativeInt4, native_status


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="2048x2048", help="NxK of each matrix (K a multiple of 128)")
    ap.add_argument("--matrices", type=int, default=500, help="how many, multiplied in turn")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    ok, why = native_status()
    if not ok:
        raise SystemExit(f"bench_stream: {why}")
    n, k = (int(v) for v in args.shape.split("x"))
    gen = torch.Generator().manual_seed(0)
    mats = [
        NativeInt4(
            torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen),
            (torch.rand(n, k // 64, generator=gen) * 0.01).half(),
            (torch.randn(n, k // 64, generator=gen) * 0.01).half(),
            64,
        )
        for _ in range(args.matrices)
    ]
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16)
    total = sum(m.codes.numel() for m in mats)
    print(
        f"{args.matrices} matrices of {n}x{k} int4 ({total / 1e9:.2f} GB of codes), load average "
        f"{os.getloadavg()[0]:.2f}"
    )
    for threads in args.threads:
        torch.set_num_threads(threads)
        times = []
        for _ in range(args.runs + 1):
            t0 = time.perf_counter()
            for m in mats:
                m(x)
            times.append(time.perf_counter() - t0)
        s = statistics.median(times[1:])  # the first pass faults the pages in
        print(f"threads {threads}: {total / s / 1e9:.1f} GB/s, {s / len(mats) * 1e6:.0f} us per matrix")


if __name__ == "__main__":
    main()
