"""Matmul on quantized weights, with the fastest kernel this torch build offers and a fallback.

Kernels, by preference:
* ``torch-int4``: torch's tinygemm int4 kernels (``_weight_int4pack_mm_for_cpu`` on CPU,
  ``_weight_int4pack_mm`` on CUDA). They take bf16 activations; int2/int3 codes fit int4 slots, so cold
  experts that travelled as int2 compute here too (the link moved int2 bytes; memory holds int4 codes).
* ``ort-int4``: onnxruntime's ``MatMulNBits`` (``quant.ort``), 4 bits with integer zero points. It needs the
  float weights (it quantizes them in its own scheme), so only weights quantized in memory can take it.
* ``native-int4``: fate-edge's own kernel (``quant.native``): int8 dot products on the portable layout (packed
  codes, fp16 or fp32 scale and zero), built on first use with the system C compiler; the default for stored codes
  wherever it runs (faster than torch's kernel there: docs/measured-choices.md). x is quantized
  to int8 per 32 values, as llama.cpp and onnxruntime do, which adds ~0.5% relative error to the weights' own.
* ``dequant``: unpack, ``codes * scale + zero``, then a plain matmul: any bit width, any device.
The choice per (bits, shape, device) is recorded in :data:`KERNEL_CHOICES` so benchmarks can report it;
:meth:`QuantizedLinear.from_float` picks among the kernels that apply by timing them once per shape and
thread count (:data:`KERNEL_TIMINGS`, microseconds per one-token call); another kernel must beat the default
by 10% to be chosen, so kernels within timing noise do not flip from run to run.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from fate_edge.quant.native import NativeInt4, native_is_default, native_supports
from fate_edge.quant.ort import OrtMatMul, ort_available
from fate_edge.quant.pack import pack, unpack
from fate_edge.quant.rtn import Quantized, dequantize, quantize
from fate_edge.quant.spec import QuantSpec

KERNEL_CHOICES: dict[tuple[int, tuple[int, int], str], str] = {}
# (bits, shape, device type, threads) for one row, with the row count appended for more
TimingKey = tuple[int, tuple[int, int], str, int] | tuple[int, tuple[int, int], str, int, int]
KERNEL_TIMINGS: dict[TimingKey, dict[str, float]] = {}
_INT4_TILES = 2  # inner k tiles of the tinygemm layout


def int4_supported(shape: tuple[int, int], spec: QuantSpec, device: torch.device) -> bool:
    n, k = shape
    if not spec.asymmetric or spec.bits > 4 or spec.group_size not in (32, 64, 128, 256):
        return False
    if device.type == "cpu":
        return hasattr(torch, "_weight_int4pack_mm_for_cpu") and k % 2 == 0 and n % 16 == 0  # packer needs N % 16
    return device.type == "cuda" and k % (_INT4_TILES * 16 * 2) == 0 and n % 8 == 0


@dataclass
class QuantizedLinear:
    """``y = x @ W.T`` for a group-quantized ``W`` [N, K]."""

    spec: QuantSpec
    shape: tuple[int, int]
    kernel: str
    packed: torch.Tensor | None  # kernel-specific packed weights (None: ort-int4 holds its own)
    scale_zero: torch.Tensor | None = None  # torch-int4: [K/g, N, 2] bf16
    q: Quantized | None = None  # dequant: codes (unpacked), scale, zero
    ort: OrtMatMul | None = None  # ort-int4
    native: NativeInt4 | None = None  # native-int4

    @classmethod
    def from_float(
        cls, w: torch.Tensor, spec: QuantSpec, device: torch.device | str = "cpu", kernel: str | None = None
    ) -> QuantizedLinear:
        """Quantize float ``w`` [N, K] for the fastest kernel here (timed once per shape), or for ``kernel``."""
        device = torch.device(device)
        shape = (w.shape[0], w.shape[1])
        if kernel is None:
            kernel = choose_kernel(w, spec, device)
        if kernel == "ort-int4":
            KERNEL_CHOICES[(spec.bits, shape, device.type)] = kernel
            return cls(spec, shape, kernel, None, ort=OrtMatMul(w, spec))
        return cls.from_quantized(quantize(w.float(), spec), spec, device, kernel)

    @classmethod
    def from_quantized(
        cls, q: Quantized, spec: QuantSpec, device: torch.device | str = "cpu", kernel: str | None = None
    ) -> QuantizedLinear:
        device = torch.device(device)
        shape = tuple(q.codes.shape)
        if kernel is None:
            kernel = default_kernel(shape, spec, device, copies=True)
        KERNEL_CHOICES[(spec.bits, shape, device.type)] = kernel
        if kernel == "native-int4":
            return cls._native(pack(q.codes, 4), q.scale, q.zero, spec, shape)
        if kernel == "torch-int4":
            packed, sz = int4_kernel_layout(q, spec, device)
            return cls(spec, shape, kernel, packed, scale_zero=sz)
        if kernel == "dequant":
            q = Quantized(q.codes.to(device), q.scale.to(device), None if q.zero is None else q.zero.to(device))
            return cls(spec, shape, kernel, q.codes, q=q)
        raise ValueError(f"unknown kernel '{kernel}' (native-int4, torch-int4 or dequant)")

    @classmethod
    def from_native(
        cls,
        codes4: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor | None,
        spec: QuantSpec,
        in_features: int | None = None,
        rows4: bool = False,
    ) -> QuantizedLinear:
        """Wrap a matrix in the native kernel's layout (:attr:`NativeInt4.parts`: 4-bit codes, fp16 scale, zero);
        ``in_features``: K of x where the parts carry zero columns past it (default: the codes' K); ``rows4``: codes
        already in rows of four (:meth:`NativeInt4.interleave_rows`)."""
        shape = (codes4.shape[0], in_features or codes4.shape[1] * 2)
        KERNEL_CHOICES[(spec.bits, shape, "cpu")] = "native-int4"
        return cls._native(codes4, scale, zero, spec, shape, rows4)

    @classmethod
    def _native(
        cls,
        codes4: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor | None,
        spec: QuantSpec,
        shape: tuple[int, int],
        rows4: bool = False,
    ) -> QuantizedLinear:
        if zero is None or spec.bits > 4 or not native_supports(shape, spec.group_size, spec.asymmetric, pad=True):
            raise ValueError(f"native-int4 does not take a {shape[0]}x{shape[1]} matrix with {spec}")
        lin = NativeInt4(codes4, scale, zero, spec.group_size, in_features=shape[1], rows4=rows4)
        return cls(spec, shape, "native-int4", lin.codes, native=lin)

    @classmethod
    def from_kernel_layout(cls, packed: torch.Tensor, scale_zero: torch.Tensor, spec: QuantSpec) -> QuantizedLinear:
        """Wrap weights already in torch's CPU int4 layout (``packed`` [N, K/2], ``scale_zero`` [K/g, N, 2])."""
        shape = (packed.shape[0], packed.shape[1] * 2)
        KERNEL_CHOICES[(spec.bits, shape, "cpu")] = "torch-int4"
        return cls(spec, shape, "torch-int4", packed, scale_zero=scale_zero)

    @classmethod
    def from_cpu_kernel_layout(
        cls,
        packed: torch.Tensor,
        scale_zero: torch.Tensor,
        spec: QuantSpec,
        device: torch.device | str,
        kernel: str | None = None,
        rows: int = 0,
    ) -> QuantizedLinear:
        """Weights stored in torch's CPU int4 layout (a store converted on a CPU host), for any ``device``: on the
        CPU a view (:meth:`from_kernel_layout`); elsewhere the codes are unpacked where the bytes are and packed for
        that device's kernel (CUDA's tinygemm takes the same [K/g, N, 2] scale and zero), or dequantized. The codes
        and scales are the stored numbers: no second rounding. ``rows``: the block order the bytes were written in
        (64 or 32, :func:`host_int4_block_rows` of the converting CPU; 0: this CPU's); on a CPU of another order the
        codes are re-packed in this one's."""
        device = torch.device(device)
        foreign = device.type == "cpu" and rows not in (0, host_int4_block_rows())
        if device.type == "cpu" and kernel in (None, "torch-int4"):
            if foreign:  # re-packed: the scales copied out too, or their view keeps the whole blob alive
                return cls.from_kernel_layout(pack_int4_cpu(unpack_int4_cpu(packed, rows)), scale_zero.clone(), spec)
            return cls.from_kernel_layout(packed, scale_zero, spec)
        shape = (packed.shape[0], packed.shape[1] * 2)
        codes = unpack_int4_cpu(packed.to(device), rows)  # c' = c + shift, tinygemm's convention: (c' - 8) * s + z'
        # The codes are re-packed: the scales must not stay a view of the blob, or they keep all of it alive
        sz = scale_zero.to(device)
        if sz.untyped_storage().nbytes() > sz.numel() * sz.element_size():
            sz = sz.clone()
        if kernel is None:
            kernel = "torch-int4" if int4_supported(shape, spec, device) else "dequant"
        KERNEL_CHOICES[(spec.bits, shape, device.type)] = kernel
        if kernel == "torch-int4":
            packed4 = torch._convert_weight_to_int4pack(
                (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8), _INT4_TILES
            )
            return cls(spec, shape, kernel, packed4, scale_zero=sz)
        if kernel != "dequant":
            raise ValueError(f"kernel {kernel!r} does not take torch's CPU int4 layout (torch-int4 or dequant)")
        scale = sz[..., 0].T.float()  # [N, K/g]
        q = Quantized(codes, scale, sz[..., 1].T.float() - 8 * scale)  # ours: c' * s + (z' - 8 * s)
        return cls(spec, shape, kernel, codes, q=q)

    @classmethod
    def from_packed(
        cls,
        packed_codes: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor | None,
        spec: QuantSpec,
        device: torch.device | str = "cpu",
        kernel: str | None = None,
    ):
        shape = (packed_codes.shape[0], packed_codes.shape[1] * 8 // spec.storage_bits)
        if kernel is None:
            kernel = default_kernel(shape, spec, torch.device(device))
        if kernel == "native-int4" and spec.storage_bits == 4:  # computes on the stored bytes: no unpacking
            return cls.from_native(packed_codes, scale, zero, spec)
        codes = unpack(packed_codes, spec.storage_bits)
        return cls.from_quantized(Quantized(codes, scale, zero), spec, device, kernel)

    def mm_bf16(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [M, K] bf16 → [M, N] bf16 on the torch-int4 kernel, without the casts ``__call__`` adds."""
        fn = torch._weight_int4pack_mm_for_cpu if x.device.type == "cpu" else torch._weight_int4pack_mm
        assert self.packed is not None and self.scale_zero is not None  # torch-int4 holds both
        return fn(x, self.packed, self.spec.group_size, self.scale_zero)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [M, K] -> [M, N]
        if self.native is not None:
            return self.native(x)
        if self.ort is not None:
            return self.ort(x)
        if self.kernel == "torch-int4":
            fn = torch._weight_int4pack_mm_for_cpu if x.device.type == "cpu" else torch._weight_int4pack_mm
            x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x  # the kernel takes [M, K] only
            assert self.packed is not None and self.scale_zero is not None  # torch-int4 holds both
            y = fn(x2.to(torch.bfloat16), self.packed, self.spec.group_size, self.scale_zero)
            return (y if x.dim() == 2 else y.view(*x.shape[:-1], -1)).to(x.dtype)
        assert self.q is not None
        return F.linear(x, dequantize(self.q, self.spec, x.dtype))

    @property
    def nbytes(self) -> int:
        if self.native is not None:
            return self.native.nbytes
        if self.ort is not None:
            return self.ort.nbytes
        if self.kernel == "torch-int4":
            tensors = [self.packed, self.scale_zero]
        else:
            assert self.q is not None  # dequant holds its codes, scale and zero
            tensors = list(self.q)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def int4_kernel_layout(
    q: Quantized, spec: QuantSpec, device: torch.device | str = "cpu", rows: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` in torch's tinygemm int4 layout on ``device``: (packed codes, ``scale_zero`` [K/g, N, 2] bf16); on the
    CPU in blocks of ``rows`` (0: this CPU's, :func:`host_int4_block_rows`)."""
    device = torch.device(device)
    # Centre narrower codes in the 4-bit slot (int2: 6..9, int3: 4..11) so zero' below is the group's
    # midpoint, small for centred weights: its bf16 rounding then costs ~2**-9 of a weight, not of 8 scales.
    shift = 8 - (spec.qmax + 1) // 2
    if device.type == "cpu":
        packed = pack_int4_cpu(q.codes + shift if shift else q.codes, rows)
    else:
        codes = q.codes.to(device=device, dtype=torch.int32) + shift
        packed = torch._convert_weight_to_int4pack((codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8), _INT4_TILES)
    # tinygemm dequantizes (c' - 8) * scale + zero' with c' = c + shift; ours is c * scale + zero,
    # so zero' = zero + (8 - shift) * scale. Its kernels take bf16 pairs: fp16 or fp32 scales (a GGUF's exact
    # q4_K ones) round here; the native kernel and dequantize-then-matmul read them as stored.
    scale = q.scale.float()
    sz = torch.stack([scale, q.zero.float() + (8 - shift) * scale], dim=-1)  # [N, K/g, 2]
    return packed, sz.transpose(0, 1).contiguous().to(device=device, dtype=torch.bfloat16)


def host_int4_block_rows() -> int:
    """Rows per block of torch's CPU int4 layout on this CPU: 64 with AVX-512, 32 with AVX2 and ARM. A store in
    that layout records the order it was written in (store.Precision.block_rows): another CPU re-packs."""
    return _block_rows(128, 128)


def pack_int4_cpu(codes: torch.Tensor, rows: int = 0) -> torch.Tensor:
    """uint8 codes [N, K] (< 16) → the bytes of ``torch._convert_weight_to_int4pack_for_cpu``, computed faster.

    torch's packer walks the matrix one code at a time from an int32 copy. Its layout is, per block of B rows
    (B = 64 with AVX-512, 32 with AVX2), byte ``k * B/2 + j`` = row ``j`` | row ``j + B/2`` << 4 (column ``k``):
    a block-wise transpose that vectorised ops build directly. A last partial block is left to torch's packer.
    The layout is checked against torch's packer once per shape on random codes; no match, torch packs.
    ``rows``: the block order to write (another CPU's, whole blocks only); 0: this CPU's."""
    n, k = codes.shape
    if rows and rows != host_int4_block_rows():
        if n % rows:
            raise ValueError(f"pack_int4_cpu: a {n}x{k} matrix is not whole blocks of {rows} rows")
        return _block_pack(codes, rows)
    rows = _block_rows(n, k)
    if not rows:
        return torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), _INT4_TILES)
    return _block_pack(codes, rows)


_INT4_BLOCK_ROWS: dict[tuple[int, int], int] = {}  # (N, K) → rows per block of torch's CPU int4 layout, 0: none


def _block_rows(n: int, k: int) -> int:
    """Rows per block of torch's CPU int4 layout for an [n, k] matrix (64 or 32), 0 if neither matches its packer."""
    rows = _INT4_BLOCK_ROWS.get((n, k))
    if rows is None:
        # Probe on at most 128 rows plus n's remainder mod 128 (same K, same last partial block): a full-size
        # int32 probe of a real lm_head (50k x 2k) took 0.4 GB at load, more than the packed model itself.
        m = min(n, 128 + n % 128)
        probe = torch.randint(0, 16, (m, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(n * k))
        want = torch._convert_weight_to_int4pack_for_cpu(probe.to(torch.int32), _INT4_TILES)
        rows = next((b for b in (64, 32) if torch.equal(_block_pack(probe, b), want)), 0)
        _INT4_BLOCK_ROWS[(n, k)] = rows
    return rows


def _block_pack(codes: torch.Tensor, rows: int) -> torch.Tensor:
    n, k = codes.shape
    full = n - n % rows
    half = rows // 2
    out = torch.empty(n, k // 2, dtype=torch.uint8, device=codes.device)
    blocks = codes[:full].view(full // rows, 2, half, k)  # [NB, 2, B/2, K]
    pairs = blocks[:, 1] << 4
    pairs |= blocks[:, 0]  # row j | row j + B/2 << 4, still row-major: contiguous passes
    out[:full].view(full // rows, k, half).copy_(pairs.transpose(1, 2))  # then one transposing copy
    if full < n:  # a partial block has its own order: torch's packer on those rows alone writes the same bytes
        out[full:] = torch._convert_weight_to_int4pack_for_cpu(codes[full:].to(torch.int32), _INT4_TILES)
    return out


def default_kernel(shape: tuple[int, int], spec: QuantSpec, device: torch.device | str, copies: bool = False) -> str:
    """The kernel codes get without timing: native-int4 where it runs (faster than torch-int4 at every row count
    measured: docs/measured-choices.md), else torch's int4 kernel where it takes
    the shape, else dequantize-then-matmul. ``copies``: the codes are a fresh copy (quantized in memory, not views
    of a stored blob), so native may pad a K that is not a multiple of 128."""
    device = torch.device(device)
    if (
        device.type == "cpu"
        and spec.bits <= 4
        and native_is_default()
        and native_supports(shape, spec.group_size, spec.asymmetric, pad=copies)
    ):
        return "native-int4"
    return "torch-int4" if int4_supported(shape, spec, device) else "dequant"


def unpack_int4_cpu(packed: torch.Tensor, rows: int = 0) -> torch.Tensor:
    """Inverse of :func:`pack_int4_cpu`: torch's CPU int4 layout [N, K/2] in blocks of ``rows`` (0: this CPU's) →
    codes uint8 [N, K] (to re-lay out a store written for torch's kernel). Whole blocks only; another shape raises."""
    n, k = packed.shape[0], packed.shape[1] * 2
    rows = rows or _block_rows(n, k)
    if not rows or n % rows:
        raise ValueError(f"unpack_int4_cpu: a {n}x{k} matrix is not whole blocks of torch's CPU int4 layout")
    pairs = packed.reshape(n // rows, k, rows // 2).transpose(1, 2)  # [NB, B/2, K]: row j | row j + B/2 << 4
    return torch.stack([pairs & 0x0F, pairs >> 4], dim=1).reshape(n, k)


def candidate_kernels(shape: tuple[int, int], spec: QuantSpec, device: torch.device) -> list[str]:
    """Kernels that can compute a ``shape`` matrix quantized with ``spec`` on ``device``."""
    out = ["torch-int4" if int4_supported(shape, spec, device) else "dequant"]
    n, k = shape
    if device.type == "cpu" and spec.bits <= 4 and native_supports(shape, spec.group_size, spec.asymmetric, pad=True):
        out.append("native-int4")
    # onnxruntime keeps its prepacked copy beside the weights (~1.8x the int4 bytes, measured): where fate-edge's
    # own kernel takes the shape, it is not worth that memory on a memory-bound device.
    if (
        device.type == "cpu"
        and spec.bits == 4
        and spec.asymmetric
        and k % spec.group_size == 0
        and ort_available()
        and "native-int4" not in out
    ):
        out.append("ort-int4")
    return out


def choose_kernel(
    w: torch.Tensor,
    spec: QuantSpec,
    device: torch.device,
    samples: int = 5,
    calls: int = 10,
    rows: tuple[int, ...] = (1,),
) -> str:
    """The fastest kernel for ``w``'s shape at each row count in ``rows`` (1: a decode token; more: a prefill
    chunk), timed once per (bits, shape, device, threads, rows) and kept in :data:`KERNEL_TIMINGS` (one row
    under the 4-part key, ``m`` rows under the key with ``m`` appended); :func:`pick_for_rows` decides."""
    shape = (w.shape[0], w.shape[1])
    base = (spec.bits, shape, device.type, torch.get_num_threads())
    keys: dict[int, TimingKey] = {m: base if m == 1 else (*base, m) for m in rows}
    missing = [m for m in rows if keys[m] not in KERNEL_TIMINGS]
    if missing:
        built = {k: QuantizedLinear.from_float(w, spec, device, k) for k in candidate_kernels(shape, spec, device)}
        for m in missing:
            x = torch.randn(m, shape[1], generator=torch.Generator().manual_seed(0)).to(device)
            n_calls = max(1, calls // m)  # a prefill chunk costs ~m decode calls: time about as long
            timings = {}
            for kernel, lin in built.items():
                lin(x)  # warm-up (first-call allocations, ORT's prepacking)
                times = []
                for _ in range(samples):
                    t0 = time.perf_counter()
                    for _ in range(n_calls):
                        lin(x)
                    times.append((time.perf_counter() - t0) / n_calls * 1e6)
                timings[kernel] = statistics.median(times)
            KERNEL_TIMINGS[keys[m]] = timings
    return pick_for_rows([KERNEL_TIMINGS[keys[m]] for m in rows])


def pick_fastest(timings: dict[str, float], margin: float = 0.10) -> str:
    """The first (default) kernel unless another is faster by more than ``margin``: kernels within timing noise of
    each other would otherwise flip between runs, and each kernel quantizes slightly differently."""
    return pick_for_rows([timings], margin)


def pick_for_rows(timings: list[dict[str, float]], margin: float = 0.10) -> str:
    """``timings``: microseconds per kernel, one dict per row count (the first dict's first kernel is the default).
    Another kernel replaces the default when it is faster by more than ``margin`` at some row count and slower by
    no more than ``margin`` at any: a prefill win may not cost decode. Among those, the lowest summed time ratio."""
    default = next(iter(timings[0]))
    best, best_cost = default, float(len(timings))
    for kernel in timings[0]:
        ratios = [t[kernel] / t[default] for t in timings]
        if min(ratios) < 1 - margin and max(ratios) <= 1 + margin and sum(ratios) < best_cost:
            best, best_cost = kernel, sum(ratios)
    return best
