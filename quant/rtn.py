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
from fate_edge.quant.pack import pack, unpack
from fate_edge.quant.spec import QuantSpec, bytes_per_weight

__all__ = ["PackedQuantized", "Quantized", "bytes_per_weight", "dequantize", "pack", "quantize", "unpack"]


class Quantized(NamedTuple):
    codes: torch.Tensor  # uint8 [..., K], one unpacked code per weight
    scale: torch.Tensor  # float16 [..., K / group_size] (float32 where a source's scales need it: GGUF q4_K)
    zero: torch.Tensor | None  # as scale; None for symmetric specs


class PackedQuantized(NamedTuple):
    """A :class:`Quantized` whose codes are already packed as :func:`pack` packs them (a GGUF's q4_0 blocks repacked
    nibble to nibble, with no byte per code in between: the convert's CPU cost per expert)."""

    packed: torch.Tensor  # uint8 [..., K * bits / 8]
    scale: torch.Tensor
    zero: torch.Tensor | None


def _fp16_round(x: torch.Tensor, up: bool) -> torch.Tensor:
    """Cast float32 ``x`` to fp16, rounding towards +inf (``up``) or -inf instead of to nearest."""
    h = x.to(torch.float16)
    toward = torch.full_like(h, float("inf") if up else float("-inf"))
    wrong = h.float() < x if up else h.float() > x
    return torch.where(wrong, torch.nextafter(h, toward), h)


BLOCK_BYTES = 1 << 20  # fp32 bytes of one block of rows: the block stays in a core's L2 through every pass


def quantize(w: torch.Tensor, spec: QuantSpec, work: torch.Tensor | None = None) -> Quantized:
    """Quantize ``w`` [..., K] (any dtype) group-wise along its last dimension.

    Rows go through one fp32 scratch block (``work``, reused between calls when given: one per thread), every
    pass in place while the block sits in cache: no full-size fp32 copy of ``w`` is ever made, so memory stays
    ``w`` + its codes whatever the size. Each element sees the same float operations in the same order as the
    textbook formula ``round((w - zero) / scale)``, so the codes do not depend on the block size."""
    k, g = w.shape[-1], spec.group_size
    if k % g:
        raise ValueError(f"last dimension {k} is not a multiple of group_size {g}")
    rows = w.reshape(-1, k)  # a view when w is contiguous
    n, groups = rows.shape[0], k // g
    block = max(1, min(n, BLOCK_BYTES // (4 * max(k, 1))))
    if work is None or work.numel() < block * k or work.device != w.device or work.dtype != torch.float32:
        work = torch.empty(block * k, dtype=torch.float32, device=w.device)
    codes = torch.empty(n, k, dtype=torch.uint8, device=w.device)
    scale = torch.empty(n, groups, dtype=torch.float16, device=w.device)
    zero = torch.empty_like(scale) if spec.asymmetric else None
    mid = 0 if spec.asymmetric else 1 << (spec.bits - 1)
    for r0 in range(0, n, block):
        r1 = min(n, r0 + block)
        x = work[: (r1 - r0) * k].view(r1 - r0, groups, g)
        x.copy_(rows[r0:r1].view(r1 - r0, groups, g))
        if spec.asymmetric:
            lo, hi = x.amin(dim=-1), x.amax(dim=-1)  # not aminmax: it may pick the other signed zero
            _check_finite(lo, hi)
            z = _fp16_round(lo, up=False)  # zero: the group minimum rounded down to fp16
            s = _fp16_round((hi - z.float()) / spec.qmax, up=True)
            x.sub_(z.float()[..., None])
            zero[r0:r1] = z  # type: ignore[index]
        else:
            top = x.abs().amax(dim=-1)
            _check_finite(top)
            s = _fp16_round(top / (mid - 1), up=True)
        scale[r0:r1] = s
        div = torch.where(s > 0, s.float(), 1.0)  # constant group: codes are all 0 (or mid), any scale works
        x.div_(div[..., None]).round_()
        if mid:
            x.add_(mid)
        codes[r0:r1] = x.clamp_(0, spec.qmax).view(r1 - r0, k)
    if torch.isinf(scale).any():  # after every block: a nan anywhere is reported first, as it should be
        raise ValueError("quantize: a group's range overflows the fp16 scale")
    return Quantized(
        codes.view(w.shape),
        scale.view(*w.shape[:-1], groups),
        None if zero is None else zero.view(*w.shape[:-1], groups),
    )


def _check_finite(*reductions: torch.Tensor) -> None:
    # min/max/abs-max propagate nan and inf, so the group reductions see every non-finite weight.
    if not all(bool(torch.isfinite(r).all()) for r in reductions):
        raise ValueError("quantize: weights contain inf or nan")


def dequantize(q: Quantized, spec: QuantSpec, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize`: → ``dtype`` [..., K]."""
    c = q.codes.float().reshape(*q.codes.shape[:-1], -1, spec.group_size)  # [..., G, g]
    if spec.asymmetric:
        assert q.zero is not None, "asymmetric spec needs a zero per group"
        w = c * q.scale.float()[..., None] + q.zero.float()[..., None]
    else:
        w = (c - (1 << (spec.bits - 1))) * q.scale.float()[..., None]
    return w.reshape(q.codes.shape).to(dtype)
