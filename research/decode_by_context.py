"""Decode tokens/s after prompts of several lengths, resident, in one process: how a model's decode slows as its KV
cache grows (docs/performance.md, "Decode attention at longer contexts").

Every expert of the store is decoded into memory as int4 (``bench.sidebyside.resident_int4``, as
``bench-llamacpp``'s resident fate-edge sides); the prompts are fixed token ids, so two checkouts of the code run
the same work: run it from each, alternating, for a before/after comparison.

    python research/decode_by_context.py STORE --dtype bfloat16 --threads 1 --prompts 64 1024 4096
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from fate_edge.runtime.generate import GenerateConfig, stream_from_model
from fate_edge.runtime.loader import load_model
from fate_edge.tokenizer import Tokenizer
from fate_edge_lab.bench.host import cpu_model, load_average
from fate_edge_lab.bench.sidebyside import resident_int4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--resident-bits", type=int, choices=[4, 8], default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, nargs="+", default=[64, 1024, 4096], help="prompt lengths, tokens")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens timed after each prompt")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = load_model(args.store, dtype, experts=resident_int4(args.store), resident_bits=args.resident_bits)
    tok = Tokenizer(args.store)
    vocab = model.config.vocab_size
    out = {}
    for n in args.prompts:
        ids = [1000 + (i * 7919) % min(20000, vocab - 1000) for i in range(n)]  # fixed: the same work anywhere
        times = [
            time.perf_counter()
            for _ in stream_from_model(model, tok, ids, GenerateConfig(max_tokens=args.tokens + 1, ignore_eos=True))
        ]
        out[n] = round(args.tokens / (times[-1] - times[1]), 2)  # from the first decoded token on
    print(json.dumps({"decode_tok_s": out, "cpu": cpu_model(), "load_average": load_average(), **vars(args)}))


if __name__ == "__main__":
    main()
