"""The MXFP4 kernel (``quant/native/mxfp4_gemm.c``) against the native int4 one at a decode row, interleaved.

Qwen1.5-MoE's expert matrices (gate/up 1408x2048, down 2048x1408), one x row, one thread: every round runs each
kernel over enough copies of each matrix to leave the last-level cache (weights stream from DRAM, as a resident
decode's do), kernels alternating within the round. Reported: medians over rounds of microseconds per call (the
calling thread's CPU time, which other processes on a shared host do not add to) and of wall time, GB/s of the bytes
each kernel reads, the load average before and after, and the CPU.

    python research/bench_mxfp4.py --rounds 9
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import torch
from fate_edge.quant import QuantSpec, quantize
from fate_edge.quant.linear import QuantizedLinear
from fate_edge.quant.mxfp4 import Mxfp4Linear, native_mxfp4_isa, quantize_mxfp4

from fate_edge_lab.bench.host import cpu_model

SHAPES = [(1408, 2048), (2048, 1408)]
ISA = {2: "avx512", 1: "avx2"}
COPY_BYTES = 96 << 20  # per kernel and shape: past any L3 of this host


def kernels(shape: tuple[int, int]) -> dict[str, list]:
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.02
    one = {"mxfp4": Mxfp4Linear(*quantize_mxfp4(w))}
    for g in (64, 128):
        spec = QuantSpec(4, g)
        one[f"int4-g{g}"] = QuantizedLinear.from_quantized(quantize(w, spec), spec, kernel="native-int4")
    out = {}
    for name, lin in one.items():
        copies = max(1, COPY_BYTES // lin.nbytes)
        if name == "mxfp4":
            mats = [Mxfp4Linear(lin.blocks.clone(), lin.scales.clone()) for _ in range(copies)]
            for isa in range(native_mxfp4_isa(), 0, -1):  # each vector path this CPU runs
                out[f"mxfp4-{ISA[isa]}"] = [functools.partial(m, isa=isa) for m in mats]
        else:
            out[name] = [
                QuantizedLinear.from_native(*(t.clone() for t in lin.native.parts), lin.spec) for _ in range(copies)
            ]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load0 = open("/proc/loadavg").read().split()[:3]
    built = {shape: kernels(shape) for shape in SHAPES}
    x = {shape: torch.randn(1, shape[1]) for shape in SHAPES}
    cpu: dict[tuple, list[float]] = {}
    wall: dict[tuple, list[float]] = {}
    for _ in range(args.rounds):
        for shape, ks in built.items():
            for name, mats in ks.items():
                mats[0](x[shape])  # warm the call path
                c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
                for m in mats:
                    m(x[shape])
                c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
                cpu.setdefault((shape, name), []).append((c1 - c0) / len(mats) / 1e3)
                wall.setdefault((shape, name), []).append((w1 - w0) / len(mats) / 1e3)
    load1 = open("/proc/loadavg").read().split()[:3]
    print(f"CPU: {cpu_model()}, {os.cpu_count()} CPUs, {args.threads} thread(s), mxfp4 isa {native_mxfp4_isa()}")
    print(f"load average before {' '.join(load0)}, after {' '.join(load1)}; {args.rounds} interleaved rounds, 1 row")
    print(f"{'matrix':>10} {'kernel':>9} {'us (cpu)':>9} {'us (wall)':>9} {'GB/s':>6} {'vs int4-g64':>11}")
    for shape, ks in built.items():
        base = statistics.median(cpu[(shape, "int4-g64")])
        for name, mats in ks.items():
            us = statistics.median(cpu[(shape, name)])
            lin = mats[0].func if isinstance(mats[0], functools.partial) else mats[0]
            gbs = lin.nbytes / us / 1e3
            print(
                f"{shape[0]}x{shape[1]:<5} {name:>9} {us:9.1f} {statistics.median(wall[(shape, name)]):9.1f} "
                f"{gbs:6.2f} {us / base:10.2f}x"
            )


if __name__ == "__main__":
    main()
