"""The expert-popularity file calibration writes into a store's ``predictors/`` (routed tokens per MoE layer and
expert), which seeds caches and the planner."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fate_edge.errors import CalibrationError

POPULARITY_FORMAT = "fate-edge/expert-popularity"
PREDICTORS_DIR = "predictors"  # a store's folder for predictors and popularity


def popularity_json(trace: Any, model_dir: Path) -> dict[str, Any]:
    return {
        "format": POPULARITY_FORMAT,
        "version": 1,
        "model": str(model_dir),
        "tokens": trace.tokens,
        "top_k": trace.top_k,
        "num_experts": trace.num_experts,
        "layers": {str(layer): counts for layer, counts in trace.popularity().items()},
    }


def load_popularity(path: str | Path) -> dict[int, list[int]]:
    """MoE layer → routed-token count per expert, from a ``popularity.json`` written by calibrate."""
    path = Path(path)
    data = json.loads(path.read_text())
    if data.get("format") != POPULARITY_FORMAT:
        raise CalibrationError(f"{path}: not an expert-popularity file (format {data.get('format')!r})")
    return {int(layer): counts for layer, counts in data["layers"].items()}


def store_popularity(store_dir: str | Path) -> dict[int, list[int]] | None:
    """The calibration counts an expert store carries (``predictors/popularity.json``), or None."""
    path = Path(store_dir) / "predictors" / "popularity.json"
    return load_popularity(path) if path.exists() else None
