"""The expert store's index file, and the check that a folder of expert blobs still has it."""

from __future__ import annotations

from pathlib import Path

from fate_edge.errors import ModelFormatError

STORE_FILE = "store.json"


def check_store_complete(path: str | Path) -> None:
    """A directory with expert blob files but no store.json is a store that lost its index (not a Hugging Face
    checkpoint to convert): say so instead of failing later on its missing experts."""
    path = Path(path)
    blobs = sorted(p.name for p in path.glob("experts-*.bin"))
    if blobs and not (path / STORE_FILE).exists():
        raise ModelFormatError(
            f"{path}: has expert blob files ({', '.join(blobs)}) but no {STORE_FILE}: it is an "
            f"expert store whose {STORE_FILE} is missing; re-create it with `fate-edge convert "
            f"MODEL {path} --force`"
        )
