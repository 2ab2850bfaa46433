"""Prefill and decode tokens/s of fate-edge vs transformers on the same checkpoint, same thread count.

Both run fp32 on the CPU with every expert resident (this measures the forward pass, not offloading).
Each configuration is timed ``--runs`` times and the median is reported, with the ratio to transformers.

    python research/bench_forward.py --runs 5 --json bench-out/forward.json --results
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from fate_edge import bundled_model_dir, load_model
from fate_edge_lab.bench.publish import add_results_arg, publish


def time_ours(model, prompt: torch.Tensor, decode_tokens: int) -> tuple[float, float]:
    cache = model.new_cache()
    t0 = time.perf_counter()
    logits = model(prompt, cache, last_only=True)
    t1 = time.perf_counter()
    tok = logits[0, -1].argmax().view(1, 1)
    for _ in range(decode_tokens):
        tok = model(tok, cache)[0, -1].argmax().view(1, 1)
    t2 = time.perf_counter()
    return prompt.shape[1] / (t1 - t0), decode_tokens / (t2 - t1)


def time_hf(model, prompt: torch.Tensor, decode_tokens: int) -> tuple[float, float]:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    t0 = time.perf_counter()
    out = model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
    t1 = time.perf_counter()
    tok = out.logits[0, -1].argmax().view(1, 1)
    for _ in range(decode_tokens):
        out = model(tok, past_key_values=out.past_key_values, use_cache=True)
        tok = out.logits[0, -1].argmax().view(1, 1)
    t2 = time.perf_counter()
    return prompt.shape[1] / (t1 - t0), decode_tokens / (t2 - t1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(bundled_model_dir()))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", type=Path, default=Path("bench-out/forward.json"))
    add_results_arg(
        ap, "rewrite the table between the bench_forward markers of FILE (without FILE: docs/results/bench_forward.md)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    ours = load_model(args.model, dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        for n in args.prompt_tokens:
            prompt = torch.randint(0, ours.config.vocab_size, (1, n), generator=gen)
            time_ours(ours, prompt, 2), time_hf(hf, prompt, 2)  # warm-up
            res = {"ours": [], "transformers": []}
            for _ in range(args.runs):  # interleave so machine noise hits both alike
                res["ours"].append(time_ours(ours, prompt, args.decode_tokens))
                res["transformers"].append(time_hf(hf, prompt, args.decode_tokens))
            row = {"prompt_tokens": n, "decode_tokens": args.decode_tokens}
            for name, vals in res.items():
                row[f"{name}_prefill_tps"] = statistics.median(v[0] for v in vals)
                row[f"{name}_decode_tps"] = statistics.median(v[1] for v in vals)
            row["prefill_ratio"] = row["ours_prefill_tps"] / row["transformers_prefill_tps"]
            row["decode_ratio"] = row["ours_decode_tps"] / row["transformers_decode_tps"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    import transformers

    result = {
        "model": str(args.model),
        "runs": args.runs,
        "threads": args.threads,
        "dtype": "float32",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "rows": rows,
    }
    table = [
        f"Bundled model, fp32, {args.threads} threads, median of {args.runs} runs, decode {args.decode_tokens} tokens "
        f"(torch {torch.__version__}, transformers {transformers.__version__}; `research/bench_forward.py`).",
        "",
        "| prompt tokens | prefill tok/s fate-edge | prefill tok/s transformers | ratio "
        "| decode tok/s fate-edge | decode tok/s transformers | ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        table.append(
            f"| {r['prompt_tokens']} | {r['ours_prefill_tps']:.0f} | {r['transformers_prefill_tps']:.0f} "
            f"| {r['prefill_ratio']:.2f}x | {r['ours_decode_tps']:.1f} | {r['transformers_decode_tps']:.1f} "
            f"| {r['decode_ratio']:.2f}x |"
        )
    publish(result, args.json, "\n".join(table), args.results, "bench_forward")


if __name__ == "__main__":
    main()
