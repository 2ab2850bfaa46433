"""Writing measured tables into the README between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def replace_between_markers(path: str | Path, name: str, text: str) -> None:
    """Replace what stands between the two markers named ``name`` in ``path`` with ``text``."""
    path = Path(path)
    begin, end = markers(name)
    doc = path.read_text()
    if begin not in doc or end not in doc:
        raise ValueError(f"{path}: no '{begin}' ... '{end}' markers to write the table between")
    start, stop = doc.index(begin) + len(begin), doc.index(end)
    path.write_text(doc[:start] + "\n" + text + "\n" + doc[stop:])


def publish(result: dict[str, Any], json_path: str | Path, text: str, readme: str | Path | None, name: str) -> None:
    """A measuring script's outputs: ``result`` as JSON at ``json_path``, ``text`` (its table) printed, and
    written into ``readme`` between the markers named ``name`` when a README is given."""
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2))
    print(text)
    if readme:
        replace_between_markers(readme, name, text)

