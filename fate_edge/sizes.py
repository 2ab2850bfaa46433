"""One formatter for byte sizes in everything fate-edge prints."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """``512 B``, ``14.2 KB``, ``3.50 MB``, ``1.20 GB`` (decimal units, as --memory-budget reads them)."""
    n = float(n)
    if abs(n) < 1e3:
        return f"{n:.0f} B"
    for unit, scale in (("KB", 1e3), ("MB", 1e6), ("GB", 1e9)):
        if abs(n) < 1e3 * scale or unit == "GB":
            value = n / scale
            return f"{value:.2f} {unit}" if value < 10 else f"{value:.1f} {unit}"
    raise AssertionError("unreachable")
