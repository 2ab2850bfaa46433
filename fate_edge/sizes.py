"""One formatter for byte sizes in everything fate-edge prints."""

from __future__ import annotations

import math


def format_bytes(n: float, round_up: bool = False) -> str:
    """``512 B``, ``14.2 KB``, ``3.50 MB``, ``1.20 GB`` (decimal units, as --memory-budget reads them).

    ``round_up``: round up to the digits shown, for a size the reader should ask for at least ("raise
    --memory-budget to at least ..."): rounded to nearest, that advice could name a size just short of enough."""
    n = float(n)
    if abs(n) < 1e3:
        return f"{math.ceil(n) if round_up else n:.0f} B"
    for unit, scale in (("KB", 1e3), ("MB", 1e6), ("GB", 1e9)):
        if abs(n) < 1e3 * scale or unit == "GB":
            value = n / scale
            digits = 2 if value < 10 else 1
            if round_up:
                value = math.ceil(value * 10**digits - 1e-9) / 10**digits  # the tolerance: 3.5 MB stays 3.50
            return f"{value:.{digits}f} {unit}"
    raise AssertionError("unreachable")
