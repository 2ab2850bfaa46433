"""Writing measured tables into docs/results/NAME.md between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from fate_edge.apps.command_line import non_empty

RESULTS_DIR = Path("docs/results")  # one file per table, named after its markers; relative to the repository root


def add_results_arg(ap: argparse.ArgumentParser, help: str, **overrides: Any) -> None:
    """``--results [FILE]``: rewrite the command's table in FILE, or without FILE (the value ``True``) in its
    docs/results file; ``help`` says which markers and file."""
    opts: dict[str, Any] = {"nargs": "?", "const": True, "default": None, "type": non_empty, "metavar": "FILE"}
    ap.add_argument("--results", **(opts | overrides), help=help)


def results_file(name: str) -> Path:
    """Where the table named ``name`` is kept: docs/results/NAME.md."""
    return RESULTS_DIR / f"{name}.md"


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def replace_between_markers(path: str | Path, name: str, text: str) -> None:
    """Replace what stands between the two markers named ``name`` in ``path`` with ``text`` (a missing file is
    created with the markers)."""
    path = Path(path)
    begin, end = markers(name)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{begin}\n{end}\n")
    doc = path.read_text()
    if begin not in doc or end not in doc:
        raise ValueError(f"{path}: no '{begin}' ... '{end}' markers to write the table between")
    start, stop = doc.index(begin) + len(begin), doc.index(end)
    path.write_text(doc[:start] + "\n" + text + "\n" + doc[stop:])


def publish(
    result: dict[str, Any], json_path: str | Path, text: str, results: str | Path | bool | None, name: str
) -> None:
    """A measuring script's outputs: ``result`` as JSON at ``json_path``, ``text`` (its table) printed, and
    written between the markers named ``name`` of ``results`` when given (``True``: ``results_file(name)``)."""
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2))
    print(text)
    if results:
        replace_between_markers(results_file(name) if results is True else results, name, text)
