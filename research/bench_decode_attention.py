"""Latency of one decode query's attention over a KV cache: torch's ``scaled_dot_product_attention`` against
fate-edge's CPU kernel (``fate_edge.model.decode_attention``), by head layout, cached positions and dtype.

Head layouts (query heads / kv heads x head size): the bundled model (4/2 x 48), Qwen1.5-MoE-A2.7B (16/16 x 128) and
Qwen3-30B-A3B / Mixtral-like GQA (32/4 and 32/8 x 128). The caches are views of larger buffers, as a KV cache hands
them out. Each cell is the median of ``--runs`` samples of a loop of at least ``--sample-ms``; ``err`` is the
largest difference of each side from float64, beside the float32 result rounded to the dtype (the best a kernel
that returns the dtype can do).

    python research/bench_decode_attention.py --threads 1 2 --json bench-out/decode_attention.json --results

``--isa avx2 avx512`` times the kernel's paths side by side on an AVX-512 host (default: the widest this CPU runs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from fate_edge.model import decode_attention
from fate_edge_lab.bench.host import cpu_model, load_average
from fate_edge_lab.bench.publish import add_results_arg, publish

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import time_call  # noqa: E402  (one timing loop for the research benches)

LAYOUTS = {"bundled 4/2x48": (4, 2, 48), "qwen1.5-moe 16/16x128": (16, 16, 128), "gqa 32/4x128": (32, 4, 128)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ISAS = {"avx2": 1, "avx512": 2}


def measure(layout: str, length: int, dtype: str, runs: int, sample_ms: float, isa: str) -> dict:
    if decode_attention.use_isa(ISAS[isa]) != ISAS[isa]:
        raise SystemExit(f"this CPU does not run the kernel's {isa} path")
    hq, hkv, d = LAYOUTS[layout]
    g = torch.Generator().manual_seed(length)
    dt = DTYPES[dtype]
    q = torch.randn(1, hq, 1, d, generator=g).to(dt)
    k = torch.randn(1, hkv, length + 64, d, generator=g).to(dt).narrow(2, 0, length)
    v = torch.randn(1, hkv, length + 64, d, generator=g).to(dt).narrow(2, 0, length)
    scale, gqa = d**-0.5, hq != hkv
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=scale, enable_gqa=gqa)
    rounded = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=scale, enable_gqa=gqa).to(dt)

    def torch_side():
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)

    def native_side():
        return decode_attention.attend(q, k, v, scale)

    def err(t: torch.Tensor) -> float:
        return (t.double() - exact).abs().max().item()

    torch_us = time_call(torch_side, runs, sample_ms) * 1e6
    native_us = time_call(native_side, runs, sample_ms) * 1e6
    return {
        "layout": layout,
        "positions": length,
        "dtype": dtype,
        "path": isa,
        "threads": torch.get_num_threads(),
        "torch_us": torch_us,
        "native_us": native_us,
        "speedup": torch_us / native_us,
        "cache_mb": 2 * k.numel() * k.element_size() / 1e6,
        "err_torch": err(torch_side()),
        "err_native": err(native_side()),
        "err_rounding": err(rounded),
    }


def render(result: dict) -> str:
    lines = [
        f"One decode query over a KV cache: torch's `scaled_dot_product_attention` against fate-edge's kernel "
        f"(`fate_edge.model.decode_attention`); {result['cpu']}, torch {result['torch']}, median of "
        f"{result['runs']} samples, load average {result['load_average'][0]:.2f} "
        f"(`research/bench_decode_attention.py`). err: largest difference from float64; rounding: the "
        "float32 result rounded to the dtype.",
        "",
        "| layout | positions | dtype | kernel path | threads | cache MB | torch us | fate-edge us | speedup "
        "| err torch / fate-edge / rounding |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['layout']} | {r['positions']} | {r['dtype']} | {r.get('path', 'avx2')} | {r['threads']} | "
            f"{r['cache_mb']:.1f} | "
            f"{r['torch_us']:.0f} | {r['native_us']:.0f} | **{r['speedup']:.2f}x** | "
            f"{r['err_torch']:.1e} / {r['err_native']:.1e} / {r['err_rounding']:.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--sample-ms", type=float, default=20.0)
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--positions", type=int, nargs="+", default=[64, 512, 2048, 4096])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=list(DTYPES))
    ap.add_argument("--isa", nargs="+", choices=list(ISAS), help="kernel paths to time (default: the widest here)")
    ap.add_argument("--json", type=Path, default=Path("bench-out/decode_attention.json"))
    add_results_arg(
        ap,
        "rewrite the table between the bench_decode_attention markers of FILE (without FILE: "
        "docs/results/bench_decode_attention.md)",
    )
    args = ap.parse_args()
    ok, why = decode_attention.available()
    if not ok:
        raise SystemExit(f"the kernel is not available here: {why}")
    widest = decode_attention.use_isa(max(ISAS.values()))
    isas = args.isa or [next(name for name, i in ISAS.items() if i == widest)]
    rows = []
    with torch.inference_mode():
        for threads in args.threads:
            torch.set_num_threads(threads)
            for layout in args.layouts:
                for length in args.positions:
                    for dtype in args.dtypes:
                        for isa in isas:
                            rows.append(measure(layout, length, dtype, args.runs, args.sample_ms, isa))
                            print(json.dumps(rows[-1]), flush=True)
    result = {
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "runs": args.runs,
        "load_average": load_average(),
        "rows": rows,
    }
    publish(result, args.json, render(result), args.results, "bench_decode_attention")


if __name__ == "__main__":
    main()
