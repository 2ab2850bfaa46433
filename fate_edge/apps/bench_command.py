"""``fate-edge bench``: the side-by-side benchmark of fate_edge.bench as a CLI subcommand."""

from __future__ import annotations

import argparse


def cmd_bench(args: argparse.Namespace) -> int:
    from fate_edge.bench.cli import run_from_args

    return run_from_args(args)


def add_bench_parser(sub) -> argparse.ArgumentParser:
    """Register ``bench`` on the ``fate-edge`` subparsers (``sub`` from ``add_subparsers``)."""
    from fate_edge.bench.cli import add_arguments

    p = sub.add_parser("bench", help="benchmark every policy preset, the oracle and peers under memory budgets "
                       "on emulated device links (JSON, markdown table, plots)",
                       description="Side-by-side benchmark (see docs/performance.md). --quick finishes in under "
                       "10 minutes on a 2-CPU machine.")
    add_arguments(p)
    p.set_defaults(func=cmd_bench)
    return p
