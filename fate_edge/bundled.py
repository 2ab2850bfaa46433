"""The tiny MoE model shipped inside the package (trained by scripts/train_tiny_moe.py)."""

from __future__ import annotations

from pathlib import Path

BUNDLED_MODEL_DIR = Path(__file__).parent / "assets" / "tiny-moe"


def bundled_model_dir() -> Path:
    return BUNDLED_MODEL_DIR
