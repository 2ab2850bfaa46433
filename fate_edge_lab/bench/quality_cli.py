"""``fate-edge eval-quality``: the quality evaluation (quality.py), or with ``--defaults`` the default store and
compute dtype beside the old ones (default_quality.py)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--defaults" in argv:
        from fate_edge_lab.bench.default_quality import main as defaults_main

        return defaults_main([a for a in argv if a != "--defaults"])
    from fate_edge_lab.bench.quality import main as quality_main

    return quality_main(argv)


def build_parser() -> argparse.ArgumentParser:
    """The evaluation's parser (``--defaults`` and its own options are in default_quality.py)."""
    from fate_edge_lab.bench.quality import build_parser as quality_parser

    return quality_parser()
