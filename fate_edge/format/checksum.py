"""CRC32 (zlib's polynomial, the store's blob checksum) at memory speed where ISA-L is installed.

zlib's crc32 costs reader CPU on the read's critical path (a read checks its chunks as they arrive), taken from
compute on a small CPU. ISA-L's PCLMUL/PMULL folding (``isal``, a dependency with wheels for Linux x86-64/aarch64,
macOS and Windows) gives the same values an order of magnitude faster (docs/measured-choices.md). zlib stays the
fallback where no wheel exists.
"""

from __future__ import annotations

try:
    from isal.isal_zlib import crc32  # crc32(data, value=0) -> int, as zlib.crc32

    BACKEND = "isal"
except ImportError:  # no wheel for this platform: the same checksum, slower
    from zlib import crc32

    BACKEND = "zlib"

__all__ = ["BACKEND", "crc32"]
