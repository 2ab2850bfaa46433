"""Writing measured tables into the README between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``."""

from __future__ import annotations

from pathlib import Path


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
