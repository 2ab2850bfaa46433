"""Rows of a 2-D tensor stored contiguously in a file, read with ``pread`` instead of touched through a mapping.

A token embedding table held quantized in a store is memory-mapped, but a gather through the mapping page-faults,
and the kernel's readahead and fault-around bring 64-128 KB around every row into the process: a prompt of a few
thousand tokens of a 151,936-row vocabulary maps most of the table. Reading each row with ``pread`` keeps the
process to the rows a pass uses (the page cache holds the rest, which the kernel reclaims under pressure).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch


@dataclass
class FileRows:
    """A [rows, ...] tensor of ``dtype`` stored at byte ``offset`` of ``path``, row after row."""

    path: Path
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    _fd: int = field(default=-1, repr=False)

    @staticmethod
    def available() -> bool:
        """``pread`` exists here (not on Windows, where the table is gathered through its mapping instead)."""
        return hasattr(os, "pread")

    def __post_init__(self) -> None:
        # Opened once: a store replaced on disk while this runs keeps serving the file that was loaded.
        self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self.row_bytes = int(np.prod(self.shape[1:], dtype=np.int64)) * torch.empty(0, dtype=self.dtype).element_size()

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` [N] as a new [N, ...] tensor (each distinct row read once, in file order)."""
        flat = ids.reshape(-1).to(torch.int64)
        if flat.numel() == 1:  # a decode token: one read, none of the bookkeeping below
            return self._row(int(flat[0])).reshape(1, *self.shape[1:])
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.shape[0]):
            raise IndexError(f"row ids must be in [0, {self.shape[0]}), got {flat.min().item()}..{flat.max().item()}")
        rows, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        if not rows.numel():
            return torch.empty(0, *self.shape[1:], dtype=self.dtype, device="cpu")
        table = torch.stack([self._row(r) for r in rows.tolist()])
        return table.reshape(rows.numel(), *self.shape[1:]).index_select(0, inverse)

    def _row(self, r: int) -> torch.Tensor:
        """Row ``r`` as a new flat tensor of ``dtype``."""
        if not 0 <= r < self.shape[0]:
            raise IndexError(f"row ids must be in [0, {self.shape[0]}), got {r}")
        got = os.pread(self._fd, self.row_bytes, self.offset + r * self.row_bytes)
        if len(got) != self.row_bytes:
            raise OSError(
                f"{self.path}: short read of row {r} ({len(got)} of {self.row_bytes} bytes): truncated store?"
            )
        return torch.frombuffer(bytearray(got), dtype=torch.uint8).view(self.dtype)

    @property
    def fd(self) -> int:
        """The open file's descriptor (for a native reader)."""
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()
