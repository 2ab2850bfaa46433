"""Convert's round-to-nearest encoder: the exact bytes of ``quant.rtn.quantize`` + ``quant.pack``, computed fast.

``quantize`` allocates a fresh full-size fp32 tensor for each of its ~8 passes; at real shapes (an expert
matrix is 11 MB in fp32) that makes converting CPU-bound by page faults and memory traffic. Here a matrix
goes through one reused fp32 buffer of a few hundred KB, a block of rows at a time, every pass in place
while the block sits in cache. The arithmetic is the same operations in the same order, so codes, scales
and zeros are bit-identical (tests/test_convert_scale.py checks it against ``quant``).
"""

from __future__ import annotations

import torch

from fate_edge.quant import QuantSpec, pack
from fate_edge.quant.rtn import Quantized, _fp16_round, quantize

BLOCK_BYTES = 1 << 19  # fp32 bytes of one block of rows: stays in a core's L2 through all passes


def rtn_quantize(w: torch.Tensor, spec: QuantSpec, work: torch.Tensor | None = None) -> Quantized:
    """``quant.rtn.quantize(w, spec)`` for a 2-D ``w`` (any float dtype), bit for bit.

    ``work`` is an optional fp32 scratch tensor reused between calls (one per thread)."""
    if w.dim() != 2 or not spec.asymmetric or w.shape[-1] % spec.group_size:
        return quantize(w, spec)  # the general path (and its errors) for what convert never writes
    n, k = w.shape
    g = spec.group_size
    rows = max(1, min(n, BLOCK_BYTES // (4 * k)))
    if work is None or work.numel() < rows * k:
        work = torch.empty(rows * k, dtype=torch.float32)
    codes = torch.empty(n, k, dtype=torch.uint8)
    scale = torch.empty(n, k // g, dtype=torch.float16)
    zero = torch.empty(n, k // g, dtype=torch.float16)
    finite = True
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        x = work[: (r1 - r0) * k].view(r1 - r0, k // g, g)  # [rows, G, g]
        x.copy_(w[r0:r1].view(r1 - r0, k // g, g))
        lo, hi = x.amin(dim=-1), x.amax(dim=-1)  # as quantize does (aminmax may pick another signed zero)
        finite &= bool(torch.isfinite(lo).all()) and bool(torch.isfinite(hi).all())
        z = _fp16_round(lo, up=False)
        s = _fp16_round((hi - z.float()) / spec.qmax, up=True)
        zero[r0:r1], scale[r0:r1] = z, s
        div = torch.where(s > 0, s.float(), 1.0)  # constant group: codes are all 0, any scale works
        x.sub_(z.float()[..., None]).div_(div[..., None]).round_().clamp_(0, spec.qmax)
        codes[r0:r1].copy_(x.view(r1 - r0, k))
    if not finite:
        raise ValueError("quantize: weights contain inf or nan")
    if torch.isinf(scale).any():
        raise ValueError("quantize: a group's range overflows the fp16 scale")
    return Quantized(codes, scale, zero)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``quant.pack(codes, bits)`` for codes known to fit ``bits`` (RTN clamps them): shifts and ORs in uint8
    instead of an int32 sum, the same bytes."""
    per_byte = 8 // bits
    if bits not in (2, 4) or codes.shape[-1] % per_byte:
        return pack(codes, bits)
    c = codes.view(*codes.shape[:-1], -1, per_byte)  # [..., K/per_byte, per_byte]
    out = c[..., 0].clone()
    for j in range(1, per_byte):
        out |= c[..., j] << (j * bits)
    return out
