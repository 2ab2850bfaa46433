"""Interleaved A/B of builds of the native int4 kernel (``quant/native/int4_gemm.c``) at a few x rows: each C file is
compiled as fate-edge builds it (``native_build.CFLAGS``), every build runs every Qwen1.5-MoE-shaped matrix in turn
within each round, and the medians are reported as microseconds per call and GB/s of weights (codes, fp16 scales
and zeros). The builds' outputs must agree bit for bit (a kernel change that keeps the sums' order keeps them).

Timing is the calling thread's CPU time at one thread (a shared host's other processes then cost nothing but the
cache and memory traffic they cause), wall time at more. ``--hot`` multiplies one small matrix that stays in L2 (the
kernel's compute ceiling); otherwise enough copies of each matrix to leave the last-level cache (decode, fully
resident: weights stream from DRAM).

    git show main:quant/native/int4_gemm.c > /tmp/old.c
    python research/bench_int4_rows.py /tmp/old.c quant/native/int4_gemm.c --rows 1 --threads 1 --rounds 9

``--shapes 151936x2048,6144x2048`` times other matrices; ``--grouped 11264x2048,2816x2048,...`` adds one
``fe_int4_gemm_grouped`` call over those matrices (a MoE layer's experts at decode: the shared expert's gate+up,
then each routed expert's), reported as the row "grouped(...)". ``--rows4`` adds, for each build that has
``fe_int4_rows4``, a side reading the same matrices' codes in rows of four (``NativeInt4.interleave_rows``), the
layout a resident model runs on AVX-512:

    python research/bench_int4_rows.py /tmp/old.c quant/native/int4_gemm.c --rows4 --group 128 --huge-pages \
        --shapes 151936x2048,2048x2048 --threads 2
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from fate_edge.huge_pages import on_huge_pages
from fate_edge.native_build import CFLAGS, compiler
from fate_edge_lab.bench.host import cpu_model

GROUP = 64  # weights per scale (--group; the stores of the Qwen1.5-MoE shapes use 128)
SHAPES = [(1408, 2048), (2048, 1408), (5632, 2048), (2048, 5632), (2048, 2048)]
HOT_SHAPES = [(512, 2048), (256, 2048)]


def build(src: Path, folder: Path) -> ctypes.CDLL:
    out = folder / f"int4-{hashlib.sha1(src.read_bytes()).hexdigest()[:12]}.so"
    if not out.exists():
        cc = compiler()
        if cc is None:
            raise SystemExit("no C compiler")
        subprocess.run([cc, *CFLAGS, "-fPIC", "-shared", str(src), "-o", str(out), "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    lib.fe_int4_gemm.restype = ctypes.c_int
    lib.fe_int4_gemm.argtypes = (
        [ctypes.c_void_p] * 3
        + [ctypes.c_int] * 4
        + [
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
        ]
    )
    lib.fe_int4_gemm_grouped.restype = ctypes.c_int
    lib.fe_int4_gemm_grouped.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    if hasattr(lib, "fe_int4_rows4"):  # builds since codes in rows of four
        lib.fe_int4_rows4.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sources", nargs="+", type=Path)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--hot", action="store_true", help="one small matrix, resident in L2")
    ap.add_argument("--group", type=int, default=GROUP, help="weights per scale and zero (a store's group_size)")
    ap.add_argument("--isa", type=int, default=None, help="2: AVX512-VNNI, 1: AVX2 (default: this host's best)")
    ap.add_argument(
        "--huge-pages",
        action="store_true",
        help="the codes on transparent huge pages, as a loaded model holds its weights (fate_edge.huge_pages)",
    )
    ap.add_argument("--shapes", help="N x K matrices to time, e.g. 151936x2048,2048x2048 (default: a MoE layer's)")
    ap.add_argument("--grouped", help="N x K matrices multiplied by one fe_int4_gemm_grouped call")
    ap.add_argument("--rows4", action="store_true", help="also each build that can on codes in rows of four")
    ap.add_argument(
        "--working-set-mb",
        type=float,
        default=64,
        help="MB of copies of each matrix cycled through (default 64: past the last-level cache; a loaded model's "
        "weights are several hundred, their page tables past the caches too)",
    )
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="fate-edge-int4-ab-"))
    built = [build(s, folder) for s in args.sources]
    if args.isa is None:  # an AVX2-only host (AMD Zen 3) faults on the AVX-512 path
        args.isa = built[0].fe_int4_isa()
    # sides: (library, codes in rows of four), each build as it is, then (--rows4) those that read that layout
    fours = [(s, lib) for s, lib in zip(args.sources, built) if args.rows4 and hasattr(lib, "fe_int4_rows4")]
    sides = [(lib, False) for lib in built] + [(lib, True) for _, lib in fours]
    names = [str(s) for s in args.sources] + [f"{s}, rows of four" for s, _ in fours]

    def parse(spec: str) -> list[tuple[int, int]]:
        return [(int(a), int(b)) for a, b in (part.split("x") for part in spec.split(","))]

    shapes = parse(args.shapes) if args.shapes else HOT_SHAPES if args.hot else SHAPES
    group = parse(args.grouped) if args.grouped else []
    gen = torch.Generator().manual_seed(0)
    mats, xs, mats4 = [], [], []
    for n, k in shapes:
        copies = 1 if args.hot else max(2, int(args.working_set_mb * 1e6 // (n * k // 2)))
        codes = torch.randint(0, 256, (copies, n, k // 2), dtype=torch.uint8, generator=gen)
        if args.huge_pages:
            codes = on_huge_pages(codes)
        mats.append(
            [
                (
                    codes[i],
                    (torch.rand(n, k // args.group, generator=gen) * 0.01).half(),
                    (torch.randn(n, k // args.group, generator=gen) * 0.01).half(),
                )
                for i in range(copies)
            ]
        )
        xs.append(torch.randn(args.rows, k, generator=gen).bfloat16())
        if any(four for _, four in sides):  # the same codes in rows of four, in a copy of their own
            four = [(on_huge_pages(c.clone()) if args.huge_pages else c.clone(), s, z) for c, s, z in mats[-1]]
            for c, _, _ in four:
                assert next(lib for lib, f in sides if f).fe_int4_rows4(c.data_ptr(), n, k, 1) == 0
            mats4.append(four)
    # the grouped call: enough copies of the whole group to leave the last-level cache, one call per copy
    gbytes = sum(n * k // 2 for n, k in group)
    gcopies = (1 if args.hot else max(2, int(args.working_set_mb * 1e6 // gbytes))) if group else 0
    gmats = [
        [
            (
                on_huge_pages(c) if args.huge_pages else c,
                (torch.rand(n, k // args.group, generator=gen) * 0.01).half(),
                (torch.randn(n, k // args.group, generator=gen) * 0.01).half(),
                torch.randn(args.rows, k, generator=gen).bfloat16(),
                torch.empty(args.rows, n, dtype=torch.bfloat16),
            )
            for n, k in group
            for c in [torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)]
        ]
        for _ in range(gcopies)
    ]
    tables = [
        (ctypes.c_int64 * (13 * len(group)))(
            *[
                v
                for (n, k), (c, s, z, x, y) in zip(group, mats_g, strict=True)
                # fe_int4_gemm's arguments, in its order
                for v in (c.data_ptr(), s.data_ptr(), z.data_ptr(), 0, n, k, args.group)
                + (x.data_ptr(), 1, k, args.rows, y.data_ptr(), 1)
            ]
        )
        for mats_g in gmats
    ]
    clock = time.thread_time if args.threads == 1 else time.perf_counter

    def run(side: int, i: int, reps: int = 20) -> tuple[float, torch.Tensor]:
        lib, four = sides[side]
        (n, k), x = shapes[i], xs[i]
        y = torch.empty(args.rows, n, dtype=torch.bfloat16)
        t0 = clock()
        for _ in range(reps):
            for c, s, z in (mats4 if four else mats)[i]:
                rc = lib.fe_int4_gemm(
                    c.data_ptr(), s.data_ptr(), z.data_ptr(), 2 if four else 0, n, k, args.group,
                    x.data_ptr(), 1, k, args.rows, y.data_ptr(), 1, args.threads, args.isa,
                )  # fmt: skip
                assert rc == 0
        return (clock() - t0) / (reps * len(mats[i])), y

    def run_grouped(side: int, reps: int = 20) -> tuple[float, torch.Tensor]:
        lib = sides[side][0]  # the group's codes stay portable
        t0 = clock()
        for _ in range(reps):
            for table in tables:
                assert lib.fe_int4_gemm_grouped(len(group), table, args.threads, args.isa) == 0
        return (clock() - t0) / (reps * len(tables)), torch.cat([m[4].flatten() for m in gmats[0]])

    n_rows = len(shapes) + (1 if group else 0)

    def timed(side: int, i: int, reps: int = 20) -> tuple[float, torch.Tensor]:
        return run_grouped(side, reps) if i == len(shapes) else run(side, i, reps)

    for i in range(n_rows):
        shape = shapes[i] if i < len(shapes) else "grouped"
        ys = [timed(j, i, 1)[1].clone() for j in range(len(sides))]
        for j, y in enumerate(ys[1:], 1):
            if not torch.equal(ys[0], y):
                print(f"{shape}: {names[j]} differs from {names[0]}")
    times: dict[tuple[int, int], list[float]] = {(j, i): [] for j in range(len(sides)) for i in range(n_rows)}
    load0 = os.getloadavg()
    for _ in range(args.rounds):
        for i in range(n_rows):
            for j in range(len(sides)):
                times[(j, i)].append(timed(j, i)[0])
    print(
        f"{cpu_model()}; {args.rows} row(s), {args.threads} thread(s), {'hot' if args.hot else 'from DRAM'}"
        f"{', huge pages' if args.huge_pages else ''}, "
        f"median of {args.rounds} interleaved rounds; load average {load0[0]:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after"
    )
    print("| N x K | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(sides))
    rows = [(f"{n}x{k}", n * k) for n, k in shapes]
    if group:
        rows.append((f"grouped({','.join(f'{n}x{k}' for n, k in group)})", sum(n * k for n, k in group)))
    for i, (name, weights) in enumerate(rows):
        nbytes = weights / 2 + 2 * 2 * weights / args.group
        cells = []
        for j in range(len(sides)):
            med = statistics.median(times[(j, i)])
            cells.append(f"{med * 1e6:.0f} us, {nbytes / med / 1e9:.1f} GB/s")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
