"""Group-wise round-to-nearest (RTN) quantization, the scheme Fate (WWW'26, arXiv 2502.12224) uses
for its int4/int2 expert copies.

Convention (asymmetric): ``w ≈ codes * scale + zero`` per group, where ``zero`` is the value of code 0
(the group minimum rounded down to fp16). Keeping the zero in weight units rather than code units
means it never overflows fp16, and it maps directly onto torch's int4 ``scales_and_zeros`` layout
(zero' = zero + 8 * scale). Symmetric specs store no zero: ``w ≈ (codes - 2**(bits-1)) * scale``.

Scale is rounded *up* to fp16 and zero *down*, so the fp16 grid still covers the group's range and
no weight is clamped: every weight is within ``scale / 2`` of its dequantized value.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .pack import pack, unpack
from .spec import QuantSpec, bytes_per_weight

__all__ = ["Quantized", "bytes_per_weight", "dequantize", "pack", "quantize", "unpack"]


class Quantized(NamedTuple):
    codes: torch.Tensor  # uint8 [..., K], one unpacked code per weight
    scale: torch.Tensor  # float16 [..., K / group_size]
    zero: torch.Tensor | None  # float16 [..., K / group_size]; None for symmetric specs


def _fp16_round(x: torch.Tensor, up: bool) -> torch.Tensor:
    """Cast float32 ``x`` to fp16, rounding towards +inf (``up``) or -inf instead of to nearest."""
    h = x.to(torch.float16)
    toward = torch.full_like(h, float("inf") if up else float("-inf"))
    wrong = h.float() < x if up else h.float() > x
    return torch.where(wrong, torch.nextafter(h, toward), h)


def _groups(w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    if w.shape[-1] % spec.group_size:
        raise ValueError(f"last dimension {w.shape[-1]} is not a multiple of group_size {spec.group_size}")
    return w.float().reshape(*w.shape[:-1], -1, spec.group_size)  # [..., G, g]


def quantize(w: torch.Tensor, spec: QuantSpec) -> Quantized:
    """Quantize ``w`` [..., K] group-wise along its last dimension."""
    g = _groups(w, spec)
    if not torch.isfinite(g).all():
        raise ValueError("quantize: weights contain inf or nan")
    if spec.asymmetric:
        zero = _fp16_round(g.amin(dim=-1), up=False)  # [..., G]
        span = (g.amax(dim=-1) - zero.float()) / spec.qmax
        offset = zero.float()
        mid = 0
    else:
        zero = None
        mid = 1 << (spec.bits - 1)
        span = g.abs().amax(dim=-1) / (mid - 1)
        offset = torch.zeros_like(span)
    scale = _fp16_round(span, up=True)
    if torch.isinf(scale).any():
        raise ValueError("quantize: a group's range overflows the fp16 scale")
    s = torch.where(scale > 0, scale.float(), 1.0)  # constant group: codes are all 0 (or mid), any scale works
    codes = torch.round((g - offset[..., None]) / s[..., None]) + mid
    codes = codes.clamp_(0, spec.qmax).to(torch.uint8).reshape(w.shape)
    return Quantized(codes, scale, zero)


def dequantize(q: Quantized, spec: QuantSpec, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize`: → ``dtype`` [..., K]."""
    c = q.codes.float().reshape(*q.codes.shape[:-1], -1, spec.group_size)  # [..., G, g]
    if spec.asymmetric:
        assert q.zero is not None, "asymmetric spec needs a zero per group"
        w = c * q.scale.float()[..., None] + q.zero.float()[..., None]
    else:
        w = (c - (1 << (spec.bits - 1))) * q.scale.float()[..., None]
    return w.reshape(q.codes.shape).to(dtype)
