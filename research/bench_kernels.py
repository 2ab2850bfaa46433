"""Latency of one expert matmul ``y = x @ W.T`` per kernel, for 1 and 16 tokens, on expert-shaped matrices.

Kernels: torch fp32 and bf16 dense, torch int8 ``_weight_int8pack_mm`` (per-channel scales, bf16
activations), torch int4 ``_weight_int4pack_mm_for_cpu`` (through ``quant.linear.QuantizedLinear``, bf16
activations, group 64), fate-edge's own int4 kernel (``quant.native``: int8 activations per 32 values, int8 dot
products on the portable layout; only where K is a multiple of 128; ``int4-native-rows``: the same kernel
held to its row path, to show what its tiled prefill GEMM gains), onnxruntime ``MatMulNBits`` 4-bit
(``quant.ort``: group 64, integer zero points,
accuracy_level 4: int8 activations inside the kernel), and the dequantize-then-matmul
fallback (``QuantizedLinear`` kernel ``dequant``, fp32, dequantizing on every call as the fallback does).
Shapes ``N x K`` (W is [N, K]): the bundled model's expert matrices 128x192 (gate/up) and 192x128 (down),
and Qwen1.5-MoE-A2.7B-sized ones 1408x2048 (gate/up) and 2048x1408 (down).

Each cell is the median of ``--runs`` samples; a sample times a loop long enough (>= ``--sample-ms``) to
dwarf the timer. It also records which kernel ``quant/linear.py`` picks per (bits, shape) on this host.

    python research/bench_kernels.py --runs 7 --json bench-out/kernels.json --results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from fate_edge.quant import QuantSpec, quantize
from fate_edge.quant.linear import KERNEL_CHOICES, QuantizedLinear, choose_kernel
from fate_edge.quant.native import native_isa, native_status, native_supports, set_gemm_min_rows
from fate_edge.quant.ort import OrtMatMul, int_zero_quantize, ort_available

from fate_edge_lab.bench.publish import add_results_arg, publish

SHAPES = [(128, 192), (192, 128), (1408, 2048), (2048, 1408)]
GROUP = 64
KERNELS = ["fp32", "bf16", "int8", "int4-torch", "int4-native", "int4-native-rows", "int4-ort", "dequant-int4"]


def time_call(fn: Callable[[], object], runs: int, sample_ms: float) -> float:
    """Median seconds per call over ``runs`` samples."""
    fn()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < sample_ms / 1000 / 4 or n < 3:  # calibrate the loop length
        fn()
        n += 1
    reps = max(3, int(n * 4))
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        samples.append((time.perf_counter() - t0) / reps)
    return statistics.median(samples)


# ------------------------------------------------------------------------------------------- kernels
def _row_kernel_only(lin: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    """The native kernel with its tiled GEMM switched off: the row kernel at every M (what prefill ran before)."""
    before = set_gemm_min_rows(1 << 30)
    try:
        return lin(x)
    finally:
        set_gemm_min_rows(before)


def build_kernels(w: torch.Tensor, threads: int) -> tuple[dict[str, Callable[[torch.Tensor], torch.Tensor]], dict]:
    """Callables taking fp32 ``x`` [M, K] (each converts as it must), and notes per kernel."""
    notes: dict[str, str] = {}
    spec4 = QuantSpec(4, GROUP)
    w32, wbf = w.float().contiguous(), w.to(torch.bfloat16).contiguous()
    amax = w32.abs().amax(dim=1).clamp_min(1e-8)
    s8 = (amax / 127).to(torch.bfloat16)
    w8 = torch.round(w32 / s8.float()[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    q4 = quantize(w32, spec4)
    lin4 = QuantizedLinear.from_quantized(q4, spec4, kernel="torch-int4")
    deq4 = QuantizedLinear.from_quantized(q4, spec4, kernel="dequant")
    kernels: dict[str, Callable] = {
        "fp32": lambda x: F.linear(x, w32),
        "bf16": lambda x: F.linear(x.to(torch.bfloat16), wbf),
        "int8": lambda x: torch._weight_int8pack_mm(x.to(torch.bfloat16), w8, s8),
        "int4-torch": lin4,
        "dequant-int4": deq4,
    }
    if native_supports(tuple(w.shape), GROUP, True):
        native = QuantizedLinear.from_quantized(q4, spec4, kernel="native-int4")
        kernels["int4-native"] = native
        kernels["int4-native-rows"] = lambda x: _row_kernel_only(native, x)
    else:
        notes["int4-native"] = f"skipped: {native_status()[1]}" if not native_status()[0] else "K % 128 != 0"
    if ort_available():
        kernels["int4-ort"] = OrtMatMul(w32, spec4, threads)
    else:
        notes["int4-ort"] = "skipped: onnxruntime is not installed"
    return kernels, notes


def kernel_choices(shapes: list[tuple[int, int]]) -> dict[str, dict[str, str]]:
    """Which kernel quant/linear.py picks for each (bits, shape) on the CPU: from stored codes (``from_quantized``,
    what streamed experts get) and, for int4, from float weights (``from_float``: timed, what in-memory experts get)."""
    out: dict[str, dict[str, str]] = {}
    for bits in (8, 4, 3, 2):
        spec = QuantSpec(bits, GROUP)
        for n, k in shapes:
            QuantizedLinear.from_quantized(quantize(torch.zeros(n, k), spec), spec, "cpu")
            out.setdefault(f"int{bits}", {})[f"{n}x{k}"] = KERNEL_CHOICES[(bits, (n, k), "cpu")]
    spec = QuantSpec(4, GROUP)
    for n, k in shapes:
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
        out.setdefault("int4-from-float", {})[f"{n}x{k}"] = choose_kernel(w, spec, torch.device("cpu"))
    return out


def check_ort(threads: int) -> float:
    """Max relative error of the MatMulNBits graph against its own dequantized weights (layout check)."""
    w = torch.randn(128, 192, generator=torch.Generator().manual_seed(0)) * 0.05
    spec = QuantSpec(4, GROUP)
    codes, scale, zp = int_zero_quantize(w, spec)
    w_hat = ((codes.float().view(128, -1, GROUP) - zp.float()[..., None]) * scale[..., None]).view(128, 192)
    x = torch.randn(4, 192, generator=torch.Generator().manual_seed(1))
    y = OrtMatMul(w, spec, threads, accuracy_level=0)(x)  # fp32 compute: isolates the packing
    ref = x @ w_hat.T
    return float((y - ref).abs().max() / ref.abs().max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--sample-ms", type=float, default=40.0, help="minimum duration of one timed sample")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--shapes", nargs="+", default=[f"{n}x{k}" for n, k in SHAPES], help="NxK of W")
    ap.add_argument("--json", type=Path, default=Path("bench-out/kernels.json"))
    add_results_arg(
        ap, "rewrite the table between the bench_kernels markers of FILE (without FILE: docs/results/bench_kernels.md)"
    )
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]

    try:
        ort_error = check_ort(1)
        import onnxruntime

        ort_version = onnxruntime.__version__
    except ImportError as exc:
        ort_error, ort_version = None, f"unavailable ({exc})"
    rows = []
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for threads in args.threads:
            torch.set_num_threads(threads)
            for n, k in shapes:
                w = torch.randn(n, k, generator=gen) * 0.02
                kernels, notes = build_kernels(w, threads)
                for m in args.tokens:
                    x = torch.randn(m, k, generator=gen)
                    row = {"threads": threads, "shape": f"{n}x{k}", "tokens": m, "us": {}, "notes": notes}
                    for name in KERNELS:
                        if name in kernels:
                            fn = kernels[name]
                            row["us"][name] = time_call(lambda fn=fn, x=x: fn(x), args.runs, args.sample_ms) * 1e6
                    row["fastest"] = min(row["us"], key=row["us"].get)
                    four = {k: v for k, v in row["us"].items() if k.startswith(("int4", "dequant"))}
                    row["fastest_4bit"] = min(four, key=four.get)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    choices = kernel_choices(shapes)
    result = {
        "runs": args.runs,
        "threads": args.threads,
        "group_size": GROUP,
        "torch": torch.__version__,
        "onnxruntime": ort_version,
        "ort_layout_max_rel_error": ort_error,
        "native": native_isa() or native_status()[1],
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads max used",
        "load_average": os.getloadavg(),
        "rows": rows,
        "quant_linear_choice": choices,
    }
    publish(result, args.json, render(result), args.results, "bench_kernels")


def render(result: dict) -> str:
    present = [k for k in KERNELS if any(k in r["us"] for r in result["rows"])]
    lines = [
        f"µs per matmul `x[M,K] @ W[N,K].T`, median of {result['runs']} samples (torch {result['torch']}, "
        f"onnxruntime {result['onnxruntime']}; group {result['group_size']}; `research/bench_kernels.py`).",
        "int8/int4-torch take bf16 activations; int4-native is fate-edge's own kernel ("
        + str(result.get("native"))
        + "; int8 activations; from a few rows on its register-tiled GEMM), int4-native-rows the same kernel held "
        "to its row path (what prefill ran before the GEMM); int4-ort is `MatMulNBits` with accuracy_level 4; "
        "dequant-int4 unpacks and dequantizes on every call, then an fp32 matmul. Load average during the run: "
        + ", ".join(f"{v:.1f}" for v in result["load_average"])
        + " on a shared host (2 threads suffer most).",
        "",
        "| threads | N x K | M | "
        + " | ".join(present)
        + " | fastest | fastest 4-bit | quant/linear.py picks (int4) |",
        "|---:|---|---:|" + "---:|" * len(present) + "---|---|---|",
    ]
    for r in result["rows"]:
        cells = []
        for k in present:
            v = r["us"].get(k)
            cell = "–" if v is None else f"{v:.0f}" if v >= 10 else f"{v:.1f}"
            cells.append(f"**{cell}**" if k == r["fastest"] else cell)
        picked = result["quant_linear_choice"]["int4"][r["shape"]]
        lines.append(
            f"| {r['threads']} | {r['shape']} | {r['tokens']} | "
            + " | ".join(cells)
            + f" | {r['fastest']} | {r['fastest_4bit']} | {picked} |"
        )
    choice = result["quant_linear_choice"]
    picked_name = {"torch-int4": "int4-torch", "native-int4": "int4-native", "dequant": "dequant-int4"}
    slower = []
    one = min(r["threads"] for r in result["rows"])
    for r in result["rows"]:
        if r["threads"] != one:
            continue
        picked = picked_name.get(choice["int4"][r["shape"]])
        best = r["fastest_4bit"]
        ratio = r["us"][picked] / r["us"][best] if picked in r["us"] else 1.0
        if ratio >= 1.1:
            slower.append(f"{r['shape']} M={r['tokens']}: {best} {ratio:.1f}x faster than {picked}")
    lines += [
        "",
        f"Conclusion: the fastest kernel per row is in bold. At {one} thread(s), where the 4-bit kernel "
        "`quant/linear.py` picks is >10% slower than the fastest 4-bit one: "
        + ("; ".join(slower) if slower else "nowhere")
        + ".",
    ]
    if result["load_average"][0] > (os.cpu_count() or 1):
        load = result["load_average"][0]
        lines += [
            "",
            f"Caution: the load average ({load:.1f}) exceeded the {os.cpu_count()} cores, so "
            "multi-threaded cells include waits for descheduled worker threads (milliseconds where the "
            "kernel needs microseconds); rerun on an idle host before reading them.",
        ]
    lines += [
        "",
        "Kernel `quant/linear.py` picks on this host per precision: "
        + "; ".join(f"{b}: " + ", ".join(f"{s} {k}" for s, k in by.items()) for b, by in choice.items())
        + ".",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
