"""The textbook RTN encoder and bit packer, written for clarity, not speed: what ``quant.rtn.quantize`` and
``quant.pack`` were before they went fast, kept here as the reference their bytes are checked against."""

from __future__ import annotations

import torch
from fate_edge.quant import Quantized, QuantSpec
from fate_edge.quant.rtn import _fp16_round


def reference_quantize(w: torch.Tensor, spec: QuantSpec) -> Quantized:
    """Whole-tensor fp32 passes: ``codes = round((w - zero) / scale)``, scale rounded up and zero down to fp16."""
    g = w.float().reshape(*w.shape[:-1], -1, spec.group_size)  # [..., G, g]
    if not torch.isfinite(g).all():
        raise ValueError("quantize: weights contain inf or nan")
    if spec.asymmetric:
        zero = _fp16_round(g.amin(dim=-1), up=False)
        span = (g.amax(dim=-1) - zero.float()) / spec.qmax
        offset, mid = zero.float(), 0
    else:
        zero, mid = None, 1 << (spec.bits - 1)
        span = g.abs().amax(dim=-1) / (mid - 1)
        offset = torch.zeros_like(span)
    scale = _fp16_round(span, up=True)
    if torch.isinf(scale).any():
        raise ValueError("quantize: a group's range overflows the fp16 scale")
    s = torch.where(scale > 0, scale.float(), 1.0)
    codes = torch.round((g - offset[..., None]) / s[..., None]) + mid
    return Quantized(codes.clamp_(0, spec.qmax).to(torch.uint8).reshape(w.shape), scale, zero)


def reference_pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """An int32 weighted sum per byte: code ``j`` of a byte at bit ``j * bits``."""
    per_byte = 8 // bits
    if per_byte == 1:
        return codes.clone()
    c = codes.reshape(*codes.shape[:-1], -1, per_byte).to(torch.int32)
    return (c << (torch.arange(per_byte, dtype=torch.int32) * bits)).sum(dim=-1).to(torch.uint8)
