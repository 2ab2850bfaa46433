"""Make a checkpoint with realistic expert sizes but the bundled model's trained routing and outputs.

The command line of ``fate_edge_lab.synthetic.inflate`` (see there): inert expert units make one int4 expert ~2 MB
(Qwen1.5-MoE-A2.7B's size) while the outputs stay the bundled model's.

    python research/make_inflated_model.py --out /tmp/tiny-moe-inflated --int4-expert-mb 2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fate_edge import bundled_model_dir
from fate_edge_lab.synthetic.inflate import INT4_BYTES_PER_WEIGHT, inflate, inflated_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=bundled_model_dir())
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--int4-expert-mb", type=float, default=2.0, help="target size of one int4 expert")
    ap.add_argument("--intermediate", type=int, default=None, help="explicit expert intermediate size")
    args = ap.parse_args()
    hidden = json.loads((args.model / "config.json").read_text())["hidden_size"]
    size = args.intermediate or inflated_size(hidden, args.int4_expert_mb)
    inflate(args.model, args.out, size)
    print(
        f"wrote {args.out} (expert intermediate size {size}, ~{3 * hidden * size * INT4_BYTES_PER_WEIGHT / 1e6:.2f} "
        f"MB per int4 expert)"
    )


if __name__ == "__main__":
    main()
