"""Where one decode token's time goes: torch.profiler over greedy decode steps on a fully resident model.

Reports ms per token (timed without the profiler), aten ops per token, and the share of wall time per
category: matmul kernels, attention, other (small) aten ops, and the rest (Python and dispatch).

    python research/profile_decode.py --dtype float32 --experts memory --threads 2
    python research/profile_decode.py --experts int4          # every routed expert resident in int4
    python research/profile_decode.py --experts int4 --threads 1 --compile on   # one compiled graph per token
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from fate_edge import bundled_model_dir, load_model

MATMUL = (
    "aten::addmm",
    "aten::mm",
    "aten::bmm",
    "aten::mv",
    "aten::addmv",
    "aten::_weight_int4pack_mm_for_cpu",
    "aten::_weight_int8pack_mm",
    "aten::matmul",
    "aten::linear",
    "ort::MatMulNBits",
)
ATTENTION = ("aten::_scaled_dot_product", "aten::scaled_dot_product")


def int4_experts(provider):
    from fate_edge.quant import QuantSpec, quantize
    from fate_edge.quant.linear import QuantizedLinear

    from fate_edge.model.experts import InMemoryExpertProvider, QuantizedExpert

    spec = QuantSpec(4, 64)
    lin = lambda w: QuantizedLinear.from_quantized(quantize(w.float(), spec), spec)  # noqa: E731
    return InMemoryExpertProvider(
        {k: QuantizedExpert(lin(e.gate), lin(e.up), lin(e.down)) for k, e in provider.experts.items()}
    )


def decode(model, prompt: torch.Tensor, steps: int) -> float:
    """Seconds per decode token after a prefill of ``prompt``."""
    cache = model.new_cache()
    tok = model(prompt, cache, last_only=True)[0, -1].argmax().view(1, 1)
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = model(tok, cache)[0, -1].argmax().view(1, 1)
    return (time.perf_counter() - t0) / steps


def categorise(events, wall_us: float, steps: int) -> dict:
    top = [e for e in events if e.name.startswith("aten::") and not e.cpu_parent]  # top-level ops only
    counts = Counter(e.name for e in events if e.name.startswith("aten::"))
    share = {"matmul": 0.0, "attention": 0.0, "small_ops": 0.0, "compiled_graph": 0.0}
    # A compiled step runs inside one region (its kernels called from C++ with cpp_wrapper: few aten events)
    share["compiled_graph"] = sum(
        e.time_range.elapsed_us() for e in events if e.name.startswith("Torch-Compiled Region") and not e.cpu_parent
    )
    for e in top:
        us = e.time_range.elapsed_us()
        if e.name.startswith(ATTENTION):
            share["attention"] += us
        elif e.name in MATMUL:
            share["matmul"] += us
        else:
            share["small_ops"] += us
    share["python_dispatch"] = max(0.0, wall_us - sum(share.values()))
    return {
        "aten_ops_per_token": sum(counts.values()) / steps,
        "top_level_ops_per_token": len(top) / steps,
        "share": {k: round(v / wall_us, 3) for k, v in share.items()},
        "top_ops_per_token": {k: round(v / steps, 1) for k, v in counts.most_common(12)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--experts",
        default="memory",
        help="memory (checkpoint dtype), int4 (resident, quantized) or store-int4 (the converted "
        "store's int4 experts, resident: fate-edge bench-llamacpp's int4 side)",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--compile", choices=["auto", "on", "off"], default="off", help="model.set_compile")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bits = 4 if args.experts == "int4" else None
    if args.experts == "store-int4":  # as fate-edge bench-llamacpp's int4 side runs: the store's int4 experts, resident
        from fate_edge.apps.engine_args import resolve_store
        from fate_edge_lab.bench.sidebyside import resident_int4

        store = resolve_store(bundled_model_dir(), progress=False)
        model = load_model(store, dtype=args.dtype, experts=resident_int4(store))
    else:
        model = load_model(bundled_model_dir(), dtype=args.dtype, experts="memory", bits=bits)
    if bits and not hasattr(model.experts.get(model.config.moe_layers[0], 0), "kernel"):
        model.experts = int4_experts(model.experts)  # a runtime without in-memory quantization (before/after runs)
    compile_off = model.set_compile(args.compile)  # compiles now (warm), not inside the timed steps
    if compile_off not in (None, "off"):
        print(f"compiled decode off: {compile_off}")
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_tokens), generator=gen)
    with torch.inference_mode():
        decode(model, prompt, 4)
        ms = statistics.median(decode(model, prompt, args.steps) for _ in range(args.runs)) * 1e3
        cache = model.new_cache()
        tok = model(prompt, cache, last_only=True)[0, -1].argmax().view(1, 1)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                tok = model(tok, cache)[0, -1].argmax().view(1, 1)
            wall_us = (time.perf_counter() - t0) * 1e6
    out = {
        "dtype": args.dtype,
        "experts": args.experts,
        "threads": args.threads,
        "compiled": compile_off is None,
        "ms_per_token": round(ms, 3),
        "tok_s": round(1e3 / ms, 1),
        "load_average": os.getloadavg(),
        **categorise(prof.events(), wall_us, args.steps),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
