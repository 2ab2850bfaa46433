"""MXFP4 (OCP Microscaling v1.0): 4-bit E2M1 codes in blocks of 32, one E8M0 exponent byte per block.

A weight is ``e2m1(code) * 2^(scale - 127)`` with e2m1 in ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}: at most two significant
bits, so every weight decodes exactly in fp32 and in bf16 (short of 6 * 2^127, which overflows both). gpt-oss
publishes its experts so; the store keeps them as they are (no second rounding) and :class:`Mxfp4Linear` computes on
them: fate-edge's native kernel (``native/mxfp4_gemm.c``, fp32 arithmetic on blocks decoded in registers), or
dequantize-then-matmul where the native build is unavailable.

Layout (Hugging Face's ``*_blocks`` / ``*_scales`` bytes): ``blocks`` uint8 [N, K/2], byte j of a row holding the
code of k = 2j in its low nibble and k = 2j + 1 in its high one; ``scales`` uint8 [N, K/32]. E8M0 255 is NaN in the
format: :func:`check_mxfp4` refuses it at convert.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from fate_edge.quant.native import avx2_asked
from fate_edge.quant.spec import QuantSpec

from fate_edge.native_build import LazyKernel

MXFP4 = QuantSpec(4, 32, False, "mxfp4")
BLOCK = 32  # values per E8M0 scale
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class Mxfp4Weights(NamedTuple):
    """One MXFP4 matrix as a checkpoint holds it: ``blocks`` uint8 [N, K/2] and ``scales`` uint8 [N, K/32]."""

    blocks: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.blocks.shape[1] * 2


def _setup(lib: ctypes.CDLL) -> str | None:
    lib.fe_mxfp4_isa.restype = ctypes.c_int
    lib.fe_mxfp4_gemm.restype = ctypes.c_int
    lib.fe_mxfp4_gemm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.fe_mxfp4_gemm.argtypes += [ctypes.c_int] * 2 + [ctypes.c_void_p] + [ctypes.c_int] * 3
    lib.fe_mxfp4_gemm_grouped.restype = ctypes.c_int
    lib.fe_mxfp4_gemm_grouped.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.fe_mxfp4_from_ggml.restype = None
    lib.fe_mxfp4_from_ggml.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    return None  # the portable C path runs on any x86-64 CPU


_kernel = LazyKernel("fate_edge.quant", "mxfp4_gemm.c", "mxfp4_gemm", "mxfp4 kernel", _setup)
_isa: int | None = None  # native_mxfp4_isa(), once known


def native_mxfp4_status() -> tuple[bool, str]:
    """(available, why not): the native MXFP4 kernel built and loaded here."""
    return _kernel.available()


def native_mxfp4_isa() -> int:
    """3: the kernel's AVX-512 BF16 path runs here, 2: its AVX-512 path, 1: its AVX2 path, 0: its portable C path
    (-1: no native kernel).
    ``FATE_EDGE_NATIVE=avx2`` (or ``avxvnni``) keeps an AVX-512 host on the AVX2 path, as for the int4 kernel."""
    global _isa
    if _isa is None:  # once per process, as the int4 kernel reads FATE_EDGE_NATIVE (docs/measured-choices.md)
        isa = int(_kernel.lib.fe_mxfp4_isa()) if _kernel.available()[0] else -1
        _isa = min(isa, 1) if avx2_asked() else isa
    return _isa


# fp32 activations on the AVX-512 BF16 path: split into three bf16 planes (exact) and three ``vdpbf16ps`` a block,
# or the fp32 path (AVX-512). Measured on an AMD EPYC Zen 4: research/bench_mxfp4.py, docs/quantization.md (Cost).
FP32_ON_BF16_PATH = False


def default_isa(x_bf16: bool) -> int:
    """The path a call takes by default: the best here, save fp32 rows where :data:`FP32_ON_BF16_PATH` says the fp32
    path is faster."""
    isa = native_mxfp4_isa()
    return 2 if isa == 3 and not x_bf16 and not FP32_ON_BF16_PATH else isa


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes → 2^(e - 127) in fp32, exact (e = 0 is the subnormal 2^-127); 255 → NaN (the format's NaN)."""
    e = scales.to(torch.int32)
    bits = torch.where(e > 0, e << 23, torch.full_like(e, 0x00400000))
    bits = torch.where(e == 255, torch.full_like(e, 0x7FC00000), bits)
    return bits.view(torch.float32)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``blocks`` uint8 [..., K/2], ``scales`` uint8 [..., K/32] → weights [..., K] in ``dtype``: exact in fp32 and
    bf16 (each value has two significant bits), as transformers' ``convert_moe_packed_tensors`` computes them."""
    lut = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(*blocks.shape[:-1], -1, BLOCK)  # [..., G, 32]
    w = lut[codes.long()] * e8m0_to_float(scales).unsqueeze(-1)
    return w.reshape(*blocks.shape[:-1], -1).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float ``w`` [..., K] → (blocks, scales), the scheme llama.cpp's converter uses: a block's exponent is
    floor(log2(max |w|)) - 2 and each code the nearest E2M1 value (a weight past 6 * 2^e clamps to it). Weights
    already on the grid (dequantized MXFP4) come back with their own codes and scales."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"quantize_mxfp4: the last dimension {w.shape[-1]} is not a multiple of {BLOCK}")
    x = w.float().reshape(*w.shape[:-1], -1, BLOCK)
    amax = x.abs().amax(-1, keepdim=True)
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("quantize_mxfp4: weights contain inf or nan")
    e = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2 + 127, torch.zeros_like(amax)).clamp(0, 254)
    scale = e8m0_to_float(e.to(torch.uint8))
    lut = torch.tensor(E2M1, dtype=torch.float32, device=w.device)
    codes = ((x / scale).unsqueeze(-1) - lut).abs().argmin(-1).to(torch.uint8)  # first of equals: +0 before -0
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).reshape(*w.shape[:-1], -1)
    return packed, e.squeeze(-1).to(torch.uint8)


def check_mxfp4(
    name: str, blocks: torch.Tensor, scales: torch.Tensor, shape: tuple[int, ...] | None = None, values: bool = True
) -> None:
    """``blocks`` and ``scales`` of the tensor ``name`` fit each other (and ``shape``, the weight's, where given):
    uint8, blocks [..., K/2] or [..., K/32, 16] (Hugging Face's) for scales [..., K/32]; with ``values``, no E8M0 255
    (NaN: the converters scan for it, a decode need not). A ValueError naming the tensor otherwise."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 blocks and scales must be uint8, not {blocks.dtype} and {scales.dtype}")
    split = blocks.dim() == scales.dim() + 1  # [..., G, 16]
    rows = blocks.shape[:-2] if split else blocks.shape[:-1]
    width = blocks.shape[-2] * blocks.shape[-1] if split and blocks.dim() >= 2 else blocks.shape[-1]
    if (
        blocks.dim() == 0
        or scales.dim() == 0
        or (split and blocks.shape[-1] != BLOCK // 2)
        or rows != scales.shape[:-1]
        or width != scales.shape[-1] * BLOCK // 2
    ):
        raise ValueError(
            f"{name}: MXFP4 blocks {list(blocks.shape)} do not fit scales {list(scales.shape)} (16 bytes of codes "
            "per scale byte, one scale per 32 weights); the checkpoint is damaged"
        )
    if shape is not None and (*scales.shape[:-1], scales.shape[-1] * BLOCK) != tuple(shape):
        raise ValueError(
            f"{name}: MXFP4 blocks of {scales.shape[-1] * BLOCK} weights a row and {list(scales.shape[:-1])} rows "
            f"do not make the expected {list(shape)} weights; the checkpoint does not match its config"
        )
    if values and scales.numel() and int(scales.max()) == 255:
        raise ValueError(f"{name}: an MXFP4 scale is 255 (E8M0's NaN); the checkpoint is damaged")


def from_ggml(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's MXFP4 blocks (uint8 [rows, K/32 * 17]: an E8M0 byte, then k = j and j + 16 in byte j's low and high
    nibbles) → (blocks [rows, K/2], scales [rows, K/32]) in this module's layout, exact."""
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, 17)
    if _kernel.available()[0] and raw.is_contiguous():
        blocks = torch.empty(rows, b.shape[1] * 16, dtype=torch.uint8)
        scales = torch.empty(rows, b.shape[1], dtype=torch.uint8)
        _kernel.lib.fe_mxfp4_from_ggml(raw.data_ptr(), rows * b.shape[1], blocks.data_ptr(), scales.data_ptr())
        return blocks, scales
    qs = b[..., 1:]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [rows, G, 32] in k order
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).reshape(rows, -1)
    return blocks.contiguous(), b[..., 0].contiguous()


@dataclass
class Mxfp4Linear:
    """``y = x @ W.T`` for an MXFP4 ``W`` [N, K] (``blocks`` [N, K/2], ``scales`` [N, K/32], views into an expert's
    blob allowed). ``kernel``: "native-mxfp4" (fp32 arithmetic on the blocks) or "dequant" (decode, then a plain
    matmul in x's dtype: exact weights either way)."""

    blocks: torch.Tensor
    scales: torch.Tensor
    kernel: str = ""
    spec: QuantSpec = MXFP4

    def __post_init__(self) -> None:
        check_mxfp4("Mxfp4Linear", self.blocks, self.scales, values=False)  # shapes only: a decode per expert
        if not self.kernel:
            native = self.blocks.device.type == "cpu" and native_mxfp4_status()[0]
            self.kernel = "native-mxfp4" if native else "dequant"
        if self.kernel not in ("native-mxfp4", "dequant"):
            raise ValueError(f"unknown MXFP4 kernel {self.kernel!r} (native-mxfp4 or dequant)")
        if self.kernel == "native-mxfp4":
            self.blocks, self.scales = self.blocks.contiguous(), self.scales.contiguous()
        self.native = None  # no native-int4 parts: QuantizedExpert.fused() leaves the expert as it is

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.blocks.shape[1] * 2

    def __call__(self, x: torch.Tensor, isa: int | None = None) -> torch.Tensor:
        """x [..., K] → [..., N]. ``isa``: the native path to take (3 AVX-512 BF16, 2 AVX-512, 1 AVX2, 0 portable C;
        default :func:`default_isa`)."""
        if self.kernel == "dequant":
            return F.linear(x, dequantize_mxfp4(self.blocks, self.scales, x.dtype))
        n, k = self.shape
        x2 = x.reshape(-1, k)
        if x2.dtype not in (torch.float32, torch.bfloat16):
            x2 = x2.to(torch.float32)
        x2 = x2.contiguous()
        y = torch.empty(x2.shape[0], n, dtype=x2.dtype, device=x2.device)
        if x2.shape[0]:
            bf16 = int(x2.dtype == torch.bfloat16)
            use = default_isa(bool(bf16)) if isa is None else isa
            rc = _kernel.lib.fe_mxfp4_gemm(
                self.blocks.data_ptr(), self.scales.data_ptr(), n, k, x2.data_ptr(), bf16, x2.shape[0], y.data_ptr(),
                bf16, torch.get_num_threads(), use,
            )  # fmt: skip
            if rc != 0:
                raise MemoryError(f"native mxfp4 matmul {n}x{k} on {x2.shape[0]} rows: out of memory for its buffer")
        y = y.view(*x.shape[:-1], n)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def call_args(self, x: torch.Tensor, y: torch.Tensor) -> list[int]:
        """fe_mxfp4_gemm's arguments for ``y = x @ W.T`` (x [M, K] and y [M, N] contiguous, one dtype, fp32 or bf16):
        one row of :func:`gemm_grouped`'s table."""
        bf16 = int(x.dtype == torch.bfloat16)
        n, k = self.shape
        return [
            self.blocks.data_ptr(),
            self.scales.data_ptr(),
            n,
            k,
            x.data_ptr(),
            bf16,
            x.shape[0],
            y.data_ptr(),
            bf16,
        ]

    def stacked(self, other: Mxfp4Linear) -> Mxfp4Linear:
        """``self``'s rows then ``other``'s, as one matrix (a copy: rows and their scales stay apart in this layout, so
        stacking them is exact); an expert's gate and up computed in one call."""
        if self.shape[1] != other.shape[1]:
            raise ValueError(f"Mxfp4Linear.stacked: {self.shape} and {other.shape} differ in K")
        blocks, scales = torch.cat([self.blocks, other.blocks]), torch.cat([self.scales, other.scales])
        return Mxfp4Linear(blocks, scales, self.kernel)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_mxfp4(self.blocks, self.scales, dtype)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() + self.scales.numel()


def gemm_grouped(calls: list[tuple[Mxfp4Linear, torch.Tensor, torch.Tensor]]) -> None:
    """``y = x @ W.T`` for each (native-mxfp4 matrix, x [M, K], y [M, N]) in one kernel call, the threads sharing out
    whole matrices (a MoE layer's experts: ``model.grouped_experts``). Each y gets the bits of that matrix's own
    call. x and y contiguous, of one dtype (fp32 or bf16) across the calls."""
    if not calls:
        return
    bf16 = calls[0][1].dtype == torch.bfloat16
    for lin, x, y in calls:
        n, k = lin.shape
        if lin.kernel != "native-mxfp4":
            raise ValueError(f"gemm_grouped: a {n}x{k} matrix on the {lin.kernel!r} kernel, not native-mxfp4")
        if x.dim() != 2 or x.shape[1] != k or not x.is_contiguous() or (x.dtype == torch.bfloat16) != bf16:
            raise ValueError(
                f"gemm_grouped: x {tuple(x.shape)} {x.dtype} for a {n}x{k} matrix must be a contiguous [M, {k}]"
            )
        if x.dtype not in (torch.float32, torch.bfloat16) or y.dtype != x.dtype or y.shape != (x.shape[0], n):
            raise ValueError(f"gemm_grouped: y {tuple(y.shape)} {y.dtype} does not fit x {tuple(x.shape)} {x.dtype}")
        if not y.is_contiguous():
            raise ValueError(f"gemm_grouped: y {tuple(y.shape)} must be contiguous")
    live = [c for c in calls if c[1].shape[0]]
    if not live:
        return
    table = torch.tensor([lin.call_args(x, y) for lin, x, y in live], dtype=torch.int64)
    rc = _kernel.lib.fe_mxfp4_gemm_grouped(len(live), table.data_ptr(), torch.get_num_threads(), default_isa(bf16))
    if rc != 0:
        raise MemoryError(f"native mxfp4 grouped matmul of {len(live)} matrices: out of memory for its buffers")
