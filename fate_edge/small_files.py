"""Reading the small text files of a model (config.json, tokenizer files, manifests) from outside: only regular
files, only up to a size such a file can sensibly have, and one error line naming the file otherwise."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from fate_edge.errors import ModelFormatError

CONFIG_MAX_BYTES = 16 << 20  # a config.json or tokenizer_config.json; real ones are a few kB (a chat template: 10s)


def read_small_text(path: Path, most: int) -> str:
    """The UTF-8 text of the regular file ``path`` of at most ``most`` bytes. A FIFO, device or directory is
    refused without opening it for reading (a FIFO would block forever), and so is a larger file."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ModelFormatError(f"{path}: cannot read ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ModelFormatError(f"{path}: not a regular file; replace it with the model's own file")
    if st.st_size > most:
        raise ModelFormatError(f"{path}: {st.st_size} bytes, more than the {most} such a file can sensibly have")
    try:
        with open(path, "rb") as f:
            return f.read(most + 1).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelFormatError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ModelFormatError(f"{path}: cannot read ({exc.strerror})") from None


def read_json_object(path: Path, most: int = CONFIG_MAX_BYTES) -> dict[str, Any]:
    """The JSON object in the regular file ``path``; one error line naming it when it is anything else."""
    try:
        d = json.loads(read_small_text(path, most))
    except json.JSONDecodeError as exc:
        raise ModelFormatError(f"{path}: invalid JSON ({exc})") from None
    if not isinstance(d, dict):
        raise ModelFormatError(f"{path}: a JSON {type(d).__name__}, not an object")
    return d
