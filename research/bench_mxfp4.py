"""The MXFP4 kernel (``quant/native/mxfp4_gemm.c``) against the native int4 one at a decode row, interleaved.

Qwen1.5-MoE's expert matrices (gate/up 1408x2048, down 2048x1408), one x row (``--rows``), one thread: every round
runs each kernel over enough copies of each matrix to leave the last-level cache (weights stream from DRAM, as a
resident decode's do), kernels alternating within the round. MXFP4 runs each of its paths this CPU has on fp32 rows
(``fp32``; the AVX-512 BF16 path splits them into three bf16 planes) and on bf16 rows (``bf16``: a bf16 model's
activations; the AVX-512 path widens them to fp32, the BF16 path takes them as they are). Reported: medians over
rounds of microseconds per call (the calling thread's CPU time, which other processes on a shared host do not add to)
and of wall time, GB/s of the bytes each kernel reads, the load average before and after, and the CPU.

``--grouped``: a gpt-oss-20b layer's 4 routed experts (gate_up 5760x2880, down 2880x2880, biases, clamped SwiGLU) on
one row each, one call per expert (``expert(x)``) against the grouped entry (``model.grouped_experts``), interleaved.

    python research/bench_mxfp4.py --rounds 9
    python research/bench_mxfp4.py --grouped --rounds 9 --threads 2
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
ISA = {3: "avx512bf16", 2: "avx512", 1: "avx2"}
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
                for dtype in ("fp32", "bf16"):
                    out[f"mxfp4-{ISA[isa]}-{dtype}"] = [functools.partial(m, isa=isa) for m in mats]
        else:
            out[name] = [
                QuantizedLinear.from_native(*(t.clone() for t in lin.native.parts), lin.spec) for _ in range(copies)
            ]
    return out


def grouped(rounds: int, threads: int) -> None:
    from fate_edge.model.experts import ExpertBias, Glu, QuantizedExpert
    from fate_edge.model.grouped_experts import compute_group, groupable

    hidden = inter = 2880
    g = torch.Generator().manual_seed(0)

    def expert() -> QuantizedExpert:
        mats = [torch.randn(inter, hidden, generator=g) * 0.02 for _ in range(2)]
        mats.append(torch.randn(hidden, inter, generator=g) * 0.02)
        bias = ExpertBias(torch.randn(2 * inter, generator=g) * 0.01, torch.randn(hidden, generator=g) * 0.01)
        return QuantizedExpert(*(Mxfp4Linear(*quantize_mxfp4(w)) for w in mats), None, bias, Glu(limit=7.0)).fused()

    layers = [[expert() for _ in range(4)] for _ in range(2)]  # ~106 MB: past the L3
    load0 = open("/proc/loadavg").read().split()[:3]
    res: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(1, hidden, generator=g).to(dtype)
            for name in ("per expert", "grouped"):
                c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
                for experts in layers:
                    items = [(e, x) for e in experts]
                    if name == "grouped":
                        assert groupable(items)
                        compute_group(items)
                    else:
                        [e(x) for e in experts]
                c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
                key = (str(dtype).removeprefix("torch."), name)
                res.setdefault(key + ("cpu",), []).append((c1 - c0) / len(layers) / 1e3)
                res.setdefault(key + ("wall",), []).append((w1 - w0) / len(layers) / 1e3)
    load1 = open("/proc/loadavg").read().split()[:3]
    print(f"CPU: {cpu_model()}, {os.cpu_count()} CPUs, {threads} thread(s), mxfp4 isa {native_mxfp4_isa()}")
    print(f"load average before {' '.join(load0)}, after {' '.join(load1)}; {rounds} interleaved rounds")
    print("gpt-oss-20b layer, 4 experts x 1 row: us per layer (calling thread's CPU; wall)")
    for dtype in ("float32", "bfloat16"):
        for name in ("per expert", "grouped"):
            cpu = statistics.median(res[(dtype, name, "cpu")])
            wall = statistics.median(res[(dtype, name, "wall")])
            print(f"{dtype:>9} {name:>10} {cpu:9.1f} {wall:9.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--grouped", action="store_true", help="a gpt-oss layer's experts: one call each vs grouped")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.grouped:
        grouped(args.rounds, args.threads)
        return
    load0 = open("/proc/loadavg").read().split()[:3]
    built = {shape: kernels(shape) for shape in SHAPES}
    x = {shape: torch.randn(args.rows, shape[1]) for shape in SHAPES}
    cpu: dict[tuple, list[float]] = {}
    wall: dict[tuple, list[float]] = {}
    for _ in range(args.rounds):
        for shape, ks in built.items():
            for name, mats in ks.items():
                xs = x[shape].bfloat16() if name.endswith("-bf16") else x[shape]
                mats[0](xs)  # warm the call path
                c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
                for m in mats:
                    m(xs)
                c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
                cpu.setdefault((shape, name), []).append((c1 - c0) / len(mats) / 1e3)
                wall.setdefault((shape, name), []).append((w1 - w0) / len(mats) / 1e3)
    load1 = open("/proc/loadavg").read().split()[:3]
    print(f"CPU: {cpu_model()}, {os.cpu_count()} CPUs, {args.threads} thread(s), mxfp4 isa {native_mxfp4_isa()}")
    rows = f"{args.rows} row{'s' if args.rows > 1 else ''}"
    print(f"load average before {' '.join(load0)}, after {' '.join(load1)}; {args.rounds} interleaved rounds, {rows}")
    print(f"{'matrix':>10} {'kernel':>22} {'us (cpu)':>9} {'us (wall)':>9} {'GB/s':>6} {'vs int4-g64':>11}")
    for shape, ks in built.items():
        base = statistics.median(cpu[(shape, "int4-g64")])
        for name, mats in ks.items():
            us = statistics.median(cpu[(shape, name)])
            lin = mats[0].func if isinstance(mats[0], functools.partial) else mats[0]
            gbs = lin.nbytes / us / 1e3
            print(
                f"{shape[0]}x{shape[1]:<5} {name:>22} {us:9.1f} {statistics.median(wall[(shape, name)]):9.1f} "
                f"{gbs:6.2f} {us / base:10.2f}x"
            )


if __name__ == "__main__":
    main()
