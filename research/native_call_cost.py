"""The fixed cost of one native int4 call, and of waking the second thread for it.

Times, at one x row (a decode token): a ctypes call of a function that does nothing (``fe_int4_isa``), the kernel
entry with the arguments built beforehand, ``NativeInt4.__call__`` (Python, the output tensor, ctypes, quantizing
x, the scales) on a tiny matrix (16 x 128: the arithmetic is negligible) and on a decode layer's shapes, from
the cache (the same matrix called back to back). With ``--threads 2`` each call is an OpenMP parallel region: calls
back to back find the other thread spinning, calls after a pause of ``--gap-us`` (the Python between a decode
layer's kernel calls) find it spinning or asleep, by GOMP_SPINCOUNT / OMP_WAIT_POLICY: set one in the environment
(torch loads libgomp before fate_edge could choose, so without one it is libgomp's default). Medians over
``--reps`` calls, wall clock.

    GOMP_SPINCOUNT=10000 python research/native_call_cost.py --threads 2 --gap-us 200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from fate_edge.quant import QuantSpec
from fate_edge.quant.linear import QuantizedLinear
from fate_edge.quant.native import _lib, _state


def timed(fn, reps: int, gap_s: float) -> float:
    """Median µs of ``fn()`` over ``reps`` calls, each after a busy pause of ``gap_s`` (0: back to back)."""
    out = []
    for _ in range(reps):
        if gap_s:
            end = time.perf_counter() + gap_s
            while time.perf_counter() < end:  # the main thread busy (as Python between calls), not asleep
                pass
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--gap-us", type=float, default=200.0)
    ap.add_argument("--reps", type=int, default=400)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lib = _lib()
    spec = QuantSpec(4, 64)
    rows = {}
    for n, k in ((16, 128), (2048, 2048), (6144, 2048), (2048, 5632)):
        lin = QuantizedLinear.from_float(torch.randn(n, k) * 0.02, spec, kernel="native-int4")
        nat = lin.native
        assert nat is not None
        x = torch.randn(1, k).bfloat16()
        y = torch.empty(1, n, dtype=torch.bfloat16)
        args_c = nat.call_args(x, y)
        threads, isa = torch.get_num_threads(), _state.isa

        def entry(a=args_c, t=threads, i=isa) -> None:
            lib.fe_int4_gemm(*a, t, i)

        def call(m=nat, v=x) -> None:
            m(v)

        for _ in range(20):
            call()
        rows[f"{n}x{k}"] = {
            "entry_us": round(timed(entry, args.reps, 0), 2),
            "call_us": round(timed(call, args.reps, 0), 2),
            "call_after_gap_us": round(timed(call, args.reps, args.gap_us / 1e6), 2),
        }
    noop = timed(lambda: lib.fe_int4_isa(), args.reps, 0)
    out = {
        "threads": args.threads,
        "gap_us": args.gap_us,
        "openmp": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")},
        "ctypes_noop_us": round(noop, 2),
        "load_average": os.getloadavg(),
        "calls": rows,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
