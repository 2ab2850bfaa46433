"""Parity of quantized embedding tables (``load_model(embedding_bits=...)``, fate_edge/model/embedding.py).

Held-out perplexity and greedy agreement of the bundled model with its embedding table in fp32, int8 per row and
int4 per group (the held-out text and windows of `fate-edge eval-quality`, fate_edge_lab.bench.quality), then, on a
synthetic real-vocabulary slice given with --slice, the last-position logits of a few prompts against the bf16
table.

    python research/eval_embedding.py --tokens 8192
    python research/eval_embedding.py --tokens 0 --slice /tmp/qwen-2l   # a fate-edge synth checkpoint
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from fate_edge import load_model
from fate_edge_lab.bench.quality import add_eval_args, heldout_windows, run


def slice_logits(model_dir: Path, bits_list: tuple, dtype: str) -> list[dict]:
    """Last-position logits of 4 prompts of 64 token ids, quantized table against the float one."""
    rows, ref = [], None
    ids = torch.tensor([[(7 + 97 * i + 131 * j) % 151936 for j in range(64)] for i in range(4)])
    for bits in (None, *bits_list):
        model = load_model(model_dir, dtype=dtype, bits=4, embedding_bits=bits)
        with torch.no_grad():
            logits = model(ids % model.config.vocab_size, model.new_cache(), last_only=True).float()[:, -1]
        if ref is None:
            ref = logits
            continue
        rows.append(
            {
                "embedding": f"int{bits}",
                "dtype": dtype,
                "max_abs_logit_diff": round(float((logits - ref).abs().max()), 5),
                "logit_scale": round(float(ref.abs().max()), 3),
                "top1_agreement": float((logits.argmax(-1) == ref.argmax(-1)).float().mean()),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_eval_args(ap, "bench-out/embedding-quality.json")
    ap.add_argument("--slice", type=Path, default=None, help="synthetic checkpoint for the logits comparison")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows, ref = [], None
    if args.tokens:
        seqs = heldout_windows(args)
        for resident_bits in (None, 4):
            for bits in (None, 8, 4):
                model = load_model(args.model, resident_bits=resident_bits, embedding_bits=bits)
                out = run(model, seqs, args.batch, ref)
                if ref is None:
                    ref = out["argmax"]
                row = {
                    "resident": f"int{resident_bits}" if resident_bits else "fp32",
                    "embedding": f"int{bits}" if bits else "fp32",
                    "embedding_bytes": model.embed.nbytes if bits else model.embed.numel() * model.embed.element_size(),
                    "ppl": round(out["ppl"], 4),
                    "agreement": round(out.get("agreement", 1.0), 4),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    logits = slice_logits(args.slice, (8, 4), "bfloat16") if args.slice else []
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"tokens": args.tokens, "perplexity": rows, "slice_logits": logits}, indent=1))


if __name__ == "__main__":
    main()
