"""The stdlib corpus the bundled model was trained on, and its held-out rule (one copy for every user).

The training corpus is the running interpreter's standard library ``.py`` files in path order, read until
``max_corpus_bytes`` characters; a file is held out when the SHA-1 of its name hashes below
``heldout_fraction``. ``scripts/train_tiny_moe.py`` trains on this split; calibration, the quality and
model-card measurements and the benchmark's prompts read the same split from here.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class CorpusSplit:
    heldout_fraction: float = 0.02  # files whose name hashes below this go to the held-out split
    max_corpus_bytes: int = 32_000_000  # characters read before the corpus stops (files in path order)

    @classmethod
    def from_config(cls, config: dict[str, Any] | None) -> CorpusSplit:
        """The split settings in a training config (``training_log.json``'s ``config``); unknown keys ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (config or {}).items() if k in known})

    @classmethod
    def of_model(cls, model_dir: str | Path) -> CorpusSplit:
        """The settings the model in ``model_dir`` was trained with (defaults without a training log)."""
        log = Path(model_dir) / "training_log.json"
        return cls.from_config(json.loads(log.read_text()).get("config") if log.exists() else None)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files in path order (site-packages excluded)."""
    return sorted(p for p in stdlib_root().rglob("*.py") if "site-packages" not in p.parts)


def is_heldout(path: Path, fraction: float) -> bool:
    digest = hashlib.sha1(path.name.encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < fraction


def read_corpus(split: CorpusSplit | None = None) -> tuple[list[str], list[str]]:
    """(training texts, held-out texts) of the stdlib corpus under ``split``."""
    split = split or CorpusSplit()
    train: list[str] = []
    heldout: list[str] = []
    total = 0
    for path in stdlib_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        total += len(text)
        if total > split.max_corpus_bytes:
            break
        (heldout if is_heldout(path, split.heldout_fraction) else train).append(text)
    return train, heldout


def heldout_source(min_chars: int, fraction: float = 0.02) -> tuple[str, list[str]]:
    """Python source the bundled model never trained on: held-out stdlib files in path order, at least
    ``min_chars`` characters where the stdlib has them; (text, the files' paths relative to the stdlib)."""
    root = stdlib_root()
    texts, used = [], []
    for p in (p for p in stdlib_files() if is_heldout(p, fraction)):
        try:
            texts.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        used.append(str(p.relative_to(root)))
        if sum(map(len, texts)) >= min_chars:
            break
    if not texts:  # no stdlib sources (embedded Python): fall back to this file
        texts, used = [Path(__file__).read_text(encoding="utf-8")], [Path(__file__).name]
    return "\n\n".join(texts), used
