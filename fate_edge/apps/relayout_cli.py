"""``fate-edge relayout STORE OUT``: the command line of ``format.relayout``."""

from __future__ import annotations

import argparse
import time

from fate_edge.apps.command_line import command_parser, existing_path
from fate_edge.format import relayout


def build_parser() -> argparse.ArgumentParser:
    ap = command_parser("relayout", relayout.__doc__)
    ap.add_argument(
        "store", type=existing_path, help="an expert store with cpu-int4 experts (fate-edge convert --layout cpu-int4)"
    )
    ap.add_argument("out", help="the new store's directory (must not exist)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    out = relayout.relayout_store(args.store, args.out)
    print(f"wrote {out} in {time.perf_counter() - t0:.1f} s")
    return 0
