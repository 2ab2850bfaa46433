"""Re-lay out an expert store's cpu-int4 experts as portable (what fate-edge's own int4 kernel computes on), without
the checkpoint: ``python scripts/relayout_store.py STORE OUT``."""

from __future__ import annotations

import argparse
import time

from fate_edge.format.relayout import relayout_store


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("store", help="an expert store with cpu-int4 experts (fate-edge convert --layout cpu-int4)")
    ap.add_argument("out", help="the new store's directory (must not exist)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    out = relayout_store(args.store, args.out)
    print(f"wrote {out} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
