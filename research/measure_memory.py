"""Predict a run's peak RSS by part (runtime.memory_account), then run it and measure the kernel's high-water mark.

    python research/measure_memory.py STORE --memory-budget 200MB --resident-bits 4 --prompt-tokens 512

Prints the account, the measured peak after loading and after generating, and one JSON line last (the test reads
it). Run it in a fresh process: the peak (VmHWM) counts from this program's start.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from fate_edge import Engine, GenerateConfig
from fate_edge.process_memory import peak_rss_bytes
from fate_edge.runtime.budget import parse_bytes
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge.runtime.generate import PREFILL_CHUNK
from fate_edge.runtime.memory_account import memory_account


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store")
    ap.add_argument("--memory-budget", required=True)
    ap.add_argument("--resident-bits", type=int, default=None, choices=[8, 4])
    ap.add_argument("--embedding-bits", type=int, default=None, choices=[8, 4])
    ap.add_argument("--policy", default="fate-edge")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK, help="prompt tokens per pass (0: all)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    budget = parse_bytes(args.memory_budget)
    context = args.prompt_tokens + args.max_tokens
    extra = {} if args.embedding_bits is None else {"embedding_bits": args.embedding_bits}
    account = memory_account(args.store, budget, args.dtype, context, args.resident_bits, **extra)
    print("\n".join(account.lines()))
    t0 = time.perf_counter()
    engine = Engine(
        EngineConfig(args.store, budget, args.policy, dtype=args.dtype, resident_bits=args.resident_bits, **extra)
    )
    load_s, loaded = time.perf_counter() - t0, peak_rss_bytes()
    vocab = engine.model.config.vocab_size
    prompt = [(17 + 31 * i) % vocab for i in range(args.prompt_tokens)]
    engine.generate_text(
        prompt, GenerateConfig(max_tokens=args.max_tokens, ignore_eos=True, prefill_chunk=args.prefill_chunk)
    )
    engine.close()
    peak = peak_rss_bytes()
    print(
        f"load {load_s:.1f} s; measured peak after load {loaded / 1e6:.0f} MB, after generating {peak / 1e6:.0f} MB; "
        f"predicted {account.peak / 1e6:.0f} MB ({100 * (peak / account.peak - 1):+.1f}%)"
    )
    print(
        json.dumps(
            {
                "predicted": account.peak,
                "measured": peak,
                "loaded": loaded,
                "load_s": load_s,
                "running": account.running,
                "loading": account.loading,
                "runtime": account.runtime,
                "embeddings": account.embeddings,
                "embeddings_mapped": account.embeddings_mapped,
            }
        )
    )


if __name__ == "__main__":
    main()
