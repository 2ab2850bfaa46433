"""How often batching changes a greedy token: the same requests served alone and 8 at once, per dtype and expert
precision, on the bundled model (docs/batching.md).

    python research/batch_agreement.py --out docs/results/batching-agreement.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
from pathlib import Path

import torch

from fate_edge.runtime.engine import Engine
from fate_edge.runtime.generate import GenerateConfig
from fate_edge_lab.bench.throughput import PROMPTS, host_note

CASES = [
    ("float32", "load-on-demand", "bf16 experts computed in fp32"),
    ("float32", "fate-edge", "int4 experts, fp32 activations"),
    ("bfloat16", "load-on-demand", "bf16 experts and activations"),
    ("bfloat16", "fate-edge", "int4 experts, bf16 activations"),
]


def tokens(engine: Engine, prompt: str, n: int) -> list[int]:
    return [s.token for s in engine.stream(prompt, GenerateConfig(max_tokens=n, ignore_eos=True))]


def compare(dtype: str, policy: str, n: int, batch: int) -> dict:
    kw = dict(memory_budget="2MB", device="cpu", dtype=dtype, policy=policy)
    with Engine.load(max_batch=1, **kw) as alone, Engine.load(max_batch=batch, **kw) as batched:
        ref = [tokens(alone, p, n) for p in PROMPTS]
        got: list[list[int] | None] = [None] * len(PROMPTS)

        def run(i: int) -> None:
            got[i] = tokens(batched, PROMPTS[i], n)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        mean_batch = batched.batcher.stats.sequences_stepped / max(1, batched.batcher.stats.steps)
    first = [next((j for j, (a, b) in enumerate(zip(r, g)) if a != b), None) for r, g in zip(ref, got)]
    changed = [f for f in first if f is not None]
    return {
        "dtype": dtype,
        "policy": policy,
        "requests": len(PROMPTS),
        "tokens_each": n,
        "mean_batch": mean_batch,
        "requests_changed": len(changed),
        "first_change_median": statistics.median(changed) if changed else None,
        "tokens_before_first_change_share": sum(n if f is None else f for f in first) / (n * len(PROMPTS)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = []
    for dtype, policy, what in CASES:
        r = compare(dtype, policy, a.tokens, a.batch) | {"what": what}
        print(r, flush=True)
        rows.append(r)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"cases": rows, "host": host_note()}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
