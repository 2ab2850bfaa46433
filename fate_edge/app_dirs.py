"""Where fate-edge keeps what it makes once and reuses: converted stores, the host probe, the native kernel."""

from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    """``$FATE_EDGE_CACHE``, else ``$XDG_CACHE_HOME/fate-edge``, else ``~/.cache/fate-edge``."""
    root = os.environ.get("FATE_EDGE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "fate-edge"
    )
    return Path(root)
