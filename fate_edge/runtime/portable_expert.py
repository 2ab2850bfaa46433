"""An expert kept as its store blob, not decoded: the portable int4 layout that the Triton MoE kernel reads in place
(``quant.triton_moe``), for the slot decode step's opt-in (``SlotGraphDecode(..., in_place=True)``).

The scheduler makes one of these in place of a decoded expert where ``Scheduler.keeps_blobs`` is set: the uploaded
blob is the expert's memory (nothing re-packed on arrival; the cache charges the blob's bytes), and the slot step
copies it into a slot byte for byte. Called directly (a prompt's rows, a token the slot step hands to the eager
step), it decodes the blob for that call as any expert of the store would be: the same numbers, at a decode's cost.
"""

from __future__ import annotations

from typing import Any

import torch

from fate_edge.format.store import BIASES, decode_expert
from fate_edge.quant.triton_moe import Int4MoELayout


def keeps_in_place(precision: Any) -> bool:
    """Whether ``precision``'s experts can stay blobs for the in-place kernel: portable 4-bit codes, no biases, the
    plain SwiGLU (what the kernel computes)."""
    try:
        Int4MoELayout.of(precision)
    except (ValueError, KeyError):
        return False
    return precision.glu.limit is None and not any(p.name in BIASES for p in precision.parts)


class PortableExpert:
    """A portable int4 expert as its blob (a uint8 tensor on the device): ``layout`` says where its parts lie."""

    bias = None  # keeps_in_place: none

    def __init__(self, blob: torch.Tensor, precision: Any):
        self.blob = blob
        self.precision = precision
        self.glu = precision.glu
        self.layout = Int4MoELayout.of(precision, slot_bytes=blob.numel())

    @property
    def nbytes(self) -> int:
        return self.blob.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return decode_expert(self.blob, self.precision, x.dtype)(x)
