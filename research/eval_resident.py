"""Held-out perplexity of the bundled model with quantized resident weights (``load_model(resident_bits=...)``).

Uses the machinery of ``fate-edge eval-quality`` (fate_edge_lab.bench.quality: held-out stdlib text, windows,
teacher-forced NLL and greedy agreement with the reference run) over: resident fp32 / int8 / int4, each with
fp32 experts and with int4 experts (``load_model(bits=4)``, RTN, in memory).

    python research/eval_resident.py --tokens 8192 --json bench-out/resident-quality.json
"""

from __future__ import annotations

import argparse
import json

import torch

from fate_edge import load_model
from fate_edge_lab.bench.quality import add_eval_args, heldout_windows, run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_eval_args(ap, "bench-out/resident-quality.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    seqs = heldout_windows(args)
    rows, ref = [], None
    for experts_bits in (None, 4):
        for resident_bits in (None, 8, 4):
            model = load_model(args.model, bits=experts_bits, resident_bits=resident_bits)
            out = run(model, seqs, args.batch, ref)
            if ref is None:
                ref = out["argmax"]
            resident = sum(t.numel() * t.element_size() for t in model.w.values())
            row = {
                "experts": f"int{experts_bits}" if experts_bits else "fp32",
                "resident": f"int{resident_bits}" if resident_bits else "fp32",
                "resident_bytes": resident,
                "ppl": round(out["ppl"], 4),
                "agreement": round(out.get("agreement", 1.0), 4),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"tokens": int(seqs.numel()), "seq_len": args.seq_len, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
