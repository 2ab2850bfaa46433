"""Loading the checkout's scripts (scripts/NAME.py, research/NAME.py) in tests: they are files, not modules
of the package."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(path: str) -> ModuleType:
    """A script of the checkout, imported by its path relative to the checkout's root."""
    name = Path(path).stem
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module
