"""Pack unsigned integer codes (one per uint8) into dense bytes, and back.

Codes are packed along the last dimension, little-endian inside a byte: code ``j`` of a byte sits
at bit ``(j % per_byte) * bits``. 3-bit codes have no dense layout yet: they are stored in 4-bit
slots (``QuantSpec.storage_bits``), so int3 costs as much memory as int4 until a 3-bit packer lands.
"""

from __future__ import annotations

import torch

PACKABLE_BITS = (8, 4, 2)


def _check(bits: int, last_dim: int) -> int:
    if bits not in PACKABLE_BITS:
        raise ValueError(f"pack: bits must be one of {PACKABLE_BITS} (store 3-bit codes with bits=4), not {bits}")
    per_byte = 8 // bits
    if last_dim % per_byte:
        raise ValueError(f"pack: last dimension {last_dim} is not a multiple of {per_byte} codes per byte")
    return per_byte


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes ``numel`` codes occupy once packed at ``bits`` (3 counts as 4)."""
    return numel * (4 if bits == 3 else bits) // 8


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes`` uint8 [..., K] with values < 2**bits → uint8 [..., K * bits / 8]."""
    per_byte = _check(bits, codes.shape[-1])
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack: codes must be uint8, not {codes.dtype}")
    if per_byte == 1:
        return codes.clone()
    if codes.numel() and int(codes.max()) >= 1 << bits:
        raise ValueError(f"pack: a code exceeds {bits} bits")
    c = codes.reshape(*codes.shape[:-1], -1, per_byte)  # [..., K/per_byte, per_byte]
    out = c[..., 0].clone()  # shifts and ORs in uint8: no int32 copy of the codes
    for j in range(1, per_byte):
        out |= c[..., j] << (j * bits)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 [..., K * bits / 8] → codes uint8 [..., K]."""
    _check(bits, 8 // bits)
    per_byte = 8 // bits
    if per_byte == 1:
        return packed.clone()
    shifts = torch.arange(per_byte, dtype=torch.int32, device=packed.device) * bits
    c = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., B, per_byte]
    return c.reshape(*packed.shape[:-1], -1).to(torch.uint8)
