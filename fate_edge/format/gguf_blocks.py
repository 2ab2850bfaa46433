"""GGML quantized blocks as fate-edge's group-wise codes, scales and zeros (``w = code * scale + zero``), copying
the codes instead of rounding the weights again.

- q4_0: 32 weights, an fp16 ``d``, codes ``q`` in 0..15 with ``w = (q - 8) d``: group-32 int4 with
  scale ``d`` and zero ``-8 d``, both exact in fp16, and every ``code * scale + zero`` is the same number as llama.cpp's
  (+0.0 where its ``d (q - 8)`` may give -0.0).
- q8_0: 32 weights, an fp16 ``d``, int8 ``q``: group-32 int8 with codes ``q + 128``, scale ``d``, zero ``-128 d``
  (exact).
- q4_K: 256-weight super-blocks of eight 32-weight sub-blocks; fp16 ``d`` and ``dmin`` and a 6-bit scale ``sc``
  and min ``m`` per sub-block, ``w = d sc q - dmin m``: group-32 int4 with scale ``d sc`` and zero
  ``-dmin m``, both in fp32, where they are exact (11 significant bits times 6). ggml computes ``(d sc) q - dmin m``
  in fp32: ``(d sc) q`` is exact too (at most 21 bits), so its one rounding is the subtraction's, and
  ``code * scale + zero`` rounds the same sum once: the same float, signed zeros included (x - y is x + (-y)).
  The store keeps them exact in an fp32-scale precision (``gguf_convert``); an fp16 one rounds each product once.

A 4-bit block fits an 8-bit store as it is (same scale and zero), so ``--bits 8`` keeps q4 codes exact too.
"""

from __future__ import annotations

import sys

import torch

from fate_edge.quant import PackedQuantized, Quantized, QuantSpec
from fate_edge.quant.native import q4_0_codes

Q4_0, Q8_0, Q4_K = "Q4_0", "Q8_0", "Q4_K"
SOURCE_BITS = {Q4_0: 4, Q8_0: 8, Q4_K: 4}  # the code width of each block type taken without rounding
FP32_SCALES = (Q4_K,)  # block types whose scales and zeros are exact in fp32 only


def exact_into(type_name: str, spec: QuantSpec) -> bool:
    """Whether blocks of ``type_name`` go into ``spec`` with their own codes (no second rounding)."""
    return (
        type_name in SOURCE_BITS
        and spec.group_size == 32
        and spec.asymmetric
        and spec.bits >= SOURCE_BITS[type_name]
        and spec.storage_bits in (4, 8)
    )


def to_quantized(type_name: str, raw: torch.Tensor, spec: QuantSpec) -> Quantized:
    """``raw`` uint8 [rows, bytes per row] of ``type_name`` blocks → codes [rows, K], scale and zero [rows, K/32] in
    ``spec`` (which :func:`exact_into` accepts): fp16 for q4_0 and q8_0, fp32 for q4_K (see the module's notes)."""
    if not exact_into(type_name, spec):
        raise ValueError(f"{type_name} blocks do not go into {spec} without rounding")
    rows = raw.shape[0]
    if type_name == Q4_0:
        b = raw.reshape(rows, -1, 18)
        qs = b[..., 2:]
        codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # low nibbles are weights 0..15, high 16..31
        scale, zero = _q4_0_scale_zero(b)
    elif type_name == Q8_0:
        b = raw.reshape(rows, -1, 34)
        d = b[..., :2].contiguous().view(torch.float16)[..., 0]
        codes = (b[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        scale, zero = d, d * -128
    elif type_name == Q4_K:
        b = raw.reshape(rows, -1, 144)
        d = b[..., 0:2].contiguous().view(torch.float16).float()  # [rows, nb, 1]
        dmin = b[..., 2:4].contiguous().view(torch.float16).float()
        sc, mn = k_scale_min(b[..., 4:16])  # [rows, nb, 8]
        qs = b[..., 16:].reshape(rows, -1, 4, 32)  # 4 chunks of 64 weights: low nibbles then high nibbles
        codes = torch.stack([qs & 0x0F, qs >> 4], dim=3)  # [rows, nb, 4, 2, 32]
        scale = d * sc.float()  # exact in fp32, as ggml's own d * sc
        zero = -(dmin * mn.float())
    else:  # unreachable: exact_into knows only the types above
        raise AssertionError(type_name)
    codes = codes.reshape(rows, -1)
    return Quantized(codes.contiguous(), scale.reshape(rows, -1).contiguous(), zero.reshape(rows, -1).contiguous())


def to_packed(type_name: str, raw: torch.Tensor, spec: QuantSpec) -> PackedQuantized | None:
    """``raw`` q4_0 blocks straight into the portable layout's packed codes (two codes a byte, code 2j in the low
    nibble of byte j, as ``quant.pack`` packs) with fp16 scale and zero: the bytes ``pack(to_quantized(...).codes, 4)``
    gives, nibble to nibble, without a byte per code in between. None where that shortcut does not apply (another
    type, or a spec whose codes are not stored 4 bits a code)."""
    if type_name != Q4_0 or not exact_into(type_name, spec) or spec.storage_bits != 4 or sys.byteorder != "little":
        return None
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, 18)
    packed = q4_0_codes(raw.contiguous())  # in C where the native library is built (docs/measured-choices.md)
    if packed is None:
        # Byte i of a block holds weight i in its low nibble and weight i + 16 in its high one. Read as 16-bit words
        # w (bytes 2j, 2j+1, little-endian), output byte j takes weights 2j, 2j+1 from w's low nibbles of each byte,
        # and byte 8 + j weights 16 + 2j, 17 + 2j from their high nibbles: whole-word masks and shifts, no strided
        # slices (the sign an int16 shift drags in lands in bits the masks clear).
        w = b[..., 2:].contiguous().view(torch.int16)  # [rows, blocks, 8]
        w4 = w >> 4
        packed = torch.empty(*w.shape[:-1], 16, dtype=torch.uint8)
        packed[..., :8] = (w & 0x000F) | (w4 & 0x00F0)
        packed[..., 8:] = (w4 & 0x000F) | ((w >> 8) & 0x00F0)
    scale, zero = _q4_0_scale_zero(b)
    return PackedQuantized(packed.reshape(rows, -1), scale.contiguous(), zero.contiguous())


def _q4_0_scale_zero(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q4_0 blocks [rows, blocks, 18] → their fp16 scale ``d`` and zero ``-8 d`` [rows, blocks]: ``code * scale +
    zero`` is ggml's ``d (q - 8)``."""
    d = b[..., :2].contiguous().view(torch.float16)[..., 0]
    return d, d * -8


def k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q4_K's 12 bytes of packed 6-bit scales and mins → (scales, mins) [..., 8] (ggml's get_scale_min_k4)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn
