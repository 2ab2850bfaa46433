"""GGML block types dequantized in torch, float for float the same as the ``gguf`` package's numpy dequantizers.

Each function takes raw blocks (uint8 [n, type size]) and returns float32 [n, block size], doing the package's float
operations in its order (``(d * sc) * q - dmin * m`` for the K types, ...), so the results are bit-equal; only the
integer unpacking differs, which is exact. q4_0 / q8_0 take the package's ``d * (q - 8)`` / ``d * q`` here, not the
experts' ``code * scale + zero`` mapping: the values are equal, but that gives +0.0 where the package gives -0.0.
Blocks go through in chunks that stay in cache; numpy's whole-tensor passes over a 151,936 x 2048 q6_K output matrix
were most of a GGUF convert's time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fate_edge.format.gguf_blocks import k_scale_min
from fate_edge.quant.mxfp4 import dequantize_mxfp4, from_ggml

CHUNK_WEIGHTS = 1 << 20  # weights per chunk: 4 MB of float32 output; measured faster than 2^16-2^18 (fewer ops to
# dispatch) and than 2^22 (the intermediates leave the cache)


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte ``at`` of every block, as float32 [n, 1]."""
    return b[:, at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, width: int) -> torch.Tensor:
    """Bytes [n, m * width] → [n, m * 2 * width]: each run of ``width`` bytes gives its low nibbles, then its high."""
    q = qs.reshape(qs.shape[0], -1, 1, width)
    return torch.cat([q & 0x0F, q >> 4], dim=2).reshape(qs.shape[0], -1)


def _bits(qh: torch.Tensor, width: int, bits: int) -> torch.Tensor:
    """Bytes [n, m * width] → [n, m * (8 / bits) * width]: field ``j`` (``bits`` wide, from bit ``j * bits``) of every
    byte in a run of ``width`` bytes, field by field (ggml's qh layout)."""
    per_byte = 8 // bits
    q = qh.reshape(qh.shape[0], -1, 1, width)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8).reshape(1, 1, per_byte, 1)
    return ((q >> shifts) & ((1 << bits) - 1)).reshape(qh.shape[0], -1)


def _q4_0(b: torch.Tensor) -> torch.Tensor:  # d, 16 bytes of nibbles: d (q - 8)
    return _nibbles(b[:, 2:], 16).float().sub_(8).mul_(_f16(b, 0))


def _q8_0(b: torch.Tensor) -> torch.Tensor:  # d, 32 int8: d q
    return b[:, 2:].contiguous().view(torch.int8).float().mul_(_f16(b, 0))


def _q4_1(b: torch.Tensor) -> torch.Tensor:  # d, m, 16 bytes of nibbles: d q + m
    return _nibbles(b[:, 4:], 16).float().mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q5_0(b: torch.Tensor) -> torch.Tensor:  # d, 32 high bits, 16 bytes of nibbles: d (q - 16)
    q = _nibbles(b[:, 6:], 16) | (_bits(b[:, 2:6], 1, 1) << 4)
    return q.float().sub_(16).mul_(_f16(b, 0))


def _q5_1(b: torch.Tensor) -> torch.Tensor:  # d, m, 32 high bits, 16 bytes of nibbles: d q + m
    q = _nibbles(b[:, 8:], 16) | (_bits(b[:, 4:8], 1, 1) << 4)
    return q.float().mul_(_f16(b, 0)).add_(_f16(b, 2))


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q4_K / q5_K: per 32-weight sub-block, ``d * sc`` and ``dmin * m`` in float32, [n, 8, 1]."""
    sc, m = k_scale_min(b[:, 4:16])
    return (_f16(b, 0) * sc.float()).unsqueeze(-1), (_f16(b, 2) * m.float()).unsqueeze(-1)


def _q4_k(b: torch.Tensor) -> torch.Tensor:  # d, dmin, scales, 128 bytes of nibbles: d sc q - dmin m
    scale, low = _k_scales(b)
    q = _nibbles(b[:, 16:], 32).float().reshape(-1, 8, 32)
    return q.mul_(scale).sub_(low).reshape(-1, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:  # d, dmin, scales, 32 bytes of high bits, 128 of nibbles
    scale, low = _k_scales(b)
    q = (_nibbles(b[:, 48:], 32) | (_bits(b[:, 16:48], 32, 1) << 4)).float().reshape(-1, 8, 32)
    return q.mul_(scale).sub_(low).reshape(-1, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:  # 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, d
    scale = _f16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]: d * sc per 16 weights
    q = (_nibbles(b[:, :128], 64) | (_bits(b[:, 128:192], 32, 2) << 4)).float().sub_(32).reshape(-1, 16, 16)
    return q.mul_(scale.unsqueeze(-1)).reshape(-1, 256)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:  # E8M0 exponent, 16 bytes of E2M1 nibbles: exact in fp32
    return dequantize_mxfp4(*from_ggml(b.contiguous()))


_BLOCKS: dict[str, tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]] = {  # name: (weights, bytes, fn)
    "Q4_0": (32, 18, _q4_0),
    "Q8_0": (32, 34, _q8_0),
    "Q4_1": (32, 20, _q4_1),
    "Q5_0": (32, 22, _q5_0),
    "Q5_1": (32, 24, _q5_1),
    "Q4_K": (256, 144, _q4_k),
    "Q5_K": (256, 176, _q5_k),
    "Q6_K": (256, 210, _q6_k),
    "MXFP4": (32, 17, _mxfp4),
}
TORCH_TYPES = frozenset(_BLOCKS)


def dequantize_blocks(type_name: str, raw: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``raw`` uint8 [rows, bytes per row] of ``type_name`` blocks (one of :data:`TORCH_TYPES`) → [rows, K] in
    ``dtype``: computed in float32 a chunk at a time, each chunk rounded into ``dtype`` as ``.to(dtype)`` would (no
    float32 copy of the whole tensor: convert's bf16 resident tensors spent most of their time faulting it in)."""
    weights, size, fn = _BLOCKS[type_name]
    blocks = raw.reshape(-1, size)
    out = torch.empty(blocks.shape[0], weights, dtype=dtype)
    step = max(1, CHUNK_WEIGHTS // weights)
    for i in range(0, blocks.shape[0], step):
        out[i : i + step] = fn(blocks[i : i + step])
    return out.reshape(raw.shape[0], -1)
