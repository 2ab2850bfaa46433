"""The token embedding table as the model holds it, and the gather of rows from it."""

from __future__ import annotations

import torch

from .checkpoint import CheckpointReader


def embedding_bytes(reader: CheckpointReader, name: str, dtype: torch.dtype) -> int:
    """Bytes the embedding table ``name`` takes once loaded at ``dtype``."""
    numel = 1
    for d in reader.shape(name):
        numel *= d
    return numel * torch.empty(0, dtype=dtype).element_size()
