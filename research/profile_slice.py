"""Where one decode token's time goes on a real-shape slice, fully resident, as `fate-edge bench-llamacpp`'s
"fate-edge int4, int4 rest" side runs it (bf16 activations, every routed expert int4 in memory, attention, shared
expert and lm_head int4 on the native kernel): ms per token timed without the profiler, then torch.profiler's
self time per operator (kernels called through ctypes show up under the Python function that calls them, so
the int4 matmuls are timed here by wrapping ``NativeInt4.__call__`` and ``gemm_grouped``) against the bytes each
reads: the memory-bandwidth floor at ``--gbps``. The kernels' times are the process's CPU time (a shared host's
waits for a core left out; at more threads, spin-waits in).

    python research/profile_slice.py --model /data/qwen-moe-2l --threads 1
    python research/profile_slice.py --model /data/qwen-moe-8l --threads 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict

import torch
from fate_edge.quant import native
from torch.profiler import ProfilerActivity, profile, record_function

from fate_edge.format.converted_stores import ensure_store
from fate_edge.runtime.loader import load_model
from fate_edge_lab.bench.host import cpu_model
from fate_edge_lab.bench.sidebyside import resident_int4


def wrap_native() -> dict[str, list[float]]:
    """Time every native int4 call by its shape (N x K, rows), and label it for the profiler."""
    seen: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])  # seconds, bytes, calls
    call, grouped = native.NativeInt4.__call__, native.gemm_grouped

    def timed_call(self, x):
        n, k = self.shape
        key = f"int4 {n}x{k}"
        t0 = time.process_time()
        with record_function(key):
            y = call(self, x)
        s = seen[key]
        s[0] += time.process_time() - t0
        s[1] += self.nbytes
        s[2] += 1
        return y

    def timed_grouped(calls):
        key = f"int4 grouped experts ({len(calls)} matrices)"
        t0 = time.process_time()
        with record_function("int4 grouped experts"):
            grouped(calls)
        s = seen[key]
        s[0] += time.process_time() - t0
        s[1] += sum(lin.nbytes for lin, _, _ in calls)
        s[2] += 1

    native.NativeInt4.__call__ = timed_call  # type: ignore[method-assign]
    native.gemm_grouped = timed_grouped  # type: ignore[assignment]
    import fate_edge.model.grouped_experts as ge

    if hasattr(ge, "gemm_grouped"):
        ge.gemm_grouped = timed_grouped  # type: ignore[attr-defined]
    return seen


def decode(model, prompt: torch.Tensor, steps: int) -> tuple[float, float]:
    """Seconds per decode token: wall-clock and this process's CPU time."""
    cache = model.new_cache()
    cache.capacity_hint = prompt.shape[1] + steps + 8
    tok = model(prompt, cache, last_only=True)[0, -1].argmax().view(1, 1)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        tok = model(tok, cache)[0, -1].argmax().view(1, 1)
    return (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--gbps", type=float, default=0.0, help="memory bandwidth for the floor column (0: none)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    store = ensure_store(args.model, progress=False)
    model = load_model(store, torch.bfloat16, experts=resident_int4(store), resident_bits=4)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_tokens), generator=gen)
    with torch.inference_mode():
        decode(model, prompt, 4)
        runs = [decode(model, prompt, args.steps) for _ in range(args.runs)]
        ms = statistics.median(r[0] for r in runs) * 1e3
        cpu_ms = statistics.median(r[1] for r in runs) * 1e3
        seen = wrap_native()
        cache = model.new_cache()
        cache.capacity_hint = args.prompt_tokens + args.steps + 8
        tok = model(prompt, cache, last_only=True)[0, -1].argmax().view(1, 1)
        seen.clear()
        cpu0 = time.process_time()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                tok = model(tok, cache)[0, -1].argmax().view(1, 1)
            wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
    per_op: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.key_averages():
        per_op[e.key][0] += e.self_cpu_time_total / 1e3 / args.steps  # ms per token
        per_op[e.key][1] += e.count / args.steps
    top = sorted(per_op.items(), key=lambda kv: -kv[1][0])[:15]
    kern = {
        k: {
            "ms_per_token": round(v[0] * 1e3 / args.steps, 3),
            "calls_per_token": v[2] / args.steps,
            "MB_per_token": round(v[1] / 1e6 / args.steps, 2),
            "GB_per_s": round(v[1] / max(v[0], 1e-12) / 1e9, 2),
        }
        for k, v in sorted(seen.items(), key=lambda kv: -kv[1][0])
    }
    kernel_ms = sum(v["ms_per_token"] for v in kern.values())
    out = {
        "cpu": cpu_model(),
        "model": args.model,
        "threads": args.threads,
        "ms_per_token": round(ms, 3),
        "tok_s": round(1e3 / ms, 2),
        "cpu_ms_per_token": round(cpu_ms, 3),
        "cpu_tok_s": round(1e3 / cpu_ms, 2),
        "runs_ms": [round(r[0] * 1e3, 3) for r in runs],
        "profiled_ms_per_token": round(wall * 1e3 / args.steps, 3),
        "profiled_cpu_ms_per_token": round(cpu * 1e3 / args.steps, 3),
        "cpu_share_of_wall": round(cpu / wall, 3),
        "load_average": os.getloadavg(),
        "int4_kernels": kern,
        "int4_kernel_ms_per_token": round(kernel_ms, 3),
        "int4_MB_per_token": round(sum(v["MB_per_token"] for v in kern.values()), 1),
        "top_self_ops_ms_per_token": {k: [round(v[0], 3), round(v[1], 1)] for k, v in top},
    }
    if args.gbps:
        out["bandwidth_floor_ms"] = round(out["int4_MB_per_token"] / args.gbps, 3)
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
