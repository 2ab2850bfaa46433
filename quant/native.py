"""fate-edge's own int4 matmul (``native/int4_gemm.c``), built on first use with the system C compiler.

It computes on the portable store layout directly (packed codes, fp16 or fp32 scale and zero per group): no repacking
when an expert arrives, and int8 dot products (AVX512-VNNI, or AVX2) where torch's CPU int4 kernel converts every weight
to float first (docs/measured-choices.md). The shared library is cached under ``$FATE_EDGE_CACHE`` (default
``~/.cache/fate-edge``) by a hash of the source and the compiler; without a compiler, or with ``FATE_EDGE_NATIVE=0``,
:func:`native_status` says why and the other kernels are used (``FATE_EDGE_NATIVE=avx2`` keeps an AVX-512 host on the
AVX2 path, ``FATE_EDGE_NATIVE=avxvnni`` on the AVX2 path with AVX-VNNI where the CPU has it).
"""

from __future__ import annotations

import array
import ctypes
import os
import threading
from dataclasses import dataclass, field

import torch

from fate_edge.native_build import cpu_flags, load_kernel

SOURCE = "int4_gemm.c"
_ISA_NAMES = {2: "avx512-vnni", 1: "avx2"}
_AVX512_PATH = {"avx512f", "avx512bw", "avx512_vnni"}  # fe_int4_isa's level 2, as /proc/cpuinfo names it
_lock = threading.Lock()


@dataclass
class _Native:
    """The kernel library once loaded: ``reason`` says why there is none (None: not tried yet)."""

    lib: ctypes.CDLL | None = None
    isa: int = 0  # 2: AVX512-VNNI, 1: AVX2
    reason: str | None = None
    gemm_min_rows: int = 0  # 0: the instruction set's default
    avx_vnni: bool = False  # the AVX2 path's build with AVX-VNNI (FE_AVX_VNNI)


_state = _Native()


def takes_avx_vnni(choice: str | None, flags: set[str]) -> bool:
    """Whether this host loads the kernel's AVX-VNNI build (``FE_AVX_VNNI`` in native/int4_gemm.c): where the CPU has
    AVX-VNNI and its int4 calls run the AVX2 path (no AVX512-VNNI, or ``choice`` = FATE_EDGE_NATIVE = "avxvnni");
    ``FATE_EDGE_NATIVE=avx2`` keeps the plain AVX2 build (an AVX2 host without it, for comparisons)."""
    if choice == "avx2" or "avx_vnni" not in flags:
        return False
    return choice == "avxvnni" or not _AVX512_PATH <= flags


def avx2_asked() -> bool:
    """Whether ``FATE_EDGE_NATIVE`` holds an AVX-512 host to the AVX2 path ("avx2", or "avxvnni" with AVX-VNNI): read
    by every native kernel with an AVX-512 path (tests, comparisons)."""
    return os.environ.get("FATE_EDGE_NATIVE") in ("avx2", "avxvnni")


def _load() -> None:
    choice = os.environ.get("FATE_EDGE_NATIVE")
    vnni = takes_avx_vnni(choice, cpu_flags())
    lib, reason = None, ""
    if vnni:
        lib, reason = load_kernel("fate_edge.quant", SOURCE, "int4_gemm_avxvnni", "int4 kernel", ("FE_AVX_VNNI",))
        if lib is not None and lib.fe_int4_isa() == 0:  # /proc/cpuinfo said AVX-VNNI, the CPU's cpuid did not
            lib = None
        vnni = lib is not None  # else (a compiler without AVX-VNNI: GCC before 11) the build every host takes
    if lib is None:
        lib, reason = load_kernel("fate_edge.quant", SOURCE, "int4_gemm", "int4 kernel")
    if lib is None:
        _state.lib, _state.reason = None, reason
        return
    lib.fe_int4_isa.restype = ctypes.c_int
    lib.fe_int4_gemm.restype = ctypes.c_int
    lib.fe_int4_gemm.argtypes = (
        [ctypes.c_void_p] * 3
        + [ctypes.c_int] * 4  # flags (1: fp32 scales, 2: codes in rows of four), N, K, g
        + [
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
        ]
    )
    lib.fe_int4_set_gemm_min_rows.argtypes = [ctypes.c_int]
    lib.fe_int4_gemm_grouped.restype = ctypes.c_int
    lib.fe_int4_gemm_grouped.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.fe_int4_glu_grouped.restype = ctypes.c_int
    lib.fe_int4_glu_grouped.argtypes = [
        ctypes.c_int,  # first-stage matrices, their table
        ctypes.c_void_p,
        ctypes.c_int,  # activations, their table
        ctypes.c_void_p,
        ctypes.c_int,  # down matrices, their table
        ctypes.c_void_p,
        ctypes.c_void_p,  # the SiLU table
        ctypes.c_int,  # threads
        ctypes.c_int,  # isa
    ]
    lib.fe_int4_rows4.restype = ctypes.c_int
    lib.fe_int4_rows4.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.fe_q4_0_codes.restype = None
    lib.fe_q4_0_codes.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    isa = lib.fe_int4_isa()
    if avx2_asked():
        isa = min(isa, 1)
    if isa == 0:
        _state.lib, _state.reason = None, "this CPU has neither AVX2 nor AVX512-VNNI"
        return
    _state.lib, _state.isa, _state.avx_vnni = lib, isa, vnni
    _state.reason = f"built ({native_isa_name(isa, vnni)})"


def native_isa_name(isa: int, avx_vnni: bool) -> str:
    """How status lines and benchmark tables name the kernel's path: "avx512-vnni", "avx2" or "avx2+avx-vnni"."""
    return _ISA_NAMES[isa] + ("+avx-vnni" if avx_vnni and isa == 1 else "")


def native_status() -> tuple[bool, str]:
    """(available, why): built and usable here, or the reason it is not (no compiler, no AVX2, disabled)."""
    if _state.reason is not None:  # loaded (or refused) once: set last by _load, read without the lock
        return _state.lib is not None, str(_state.reason)
    with _lock:
        if _state.reason is None:
            _load()
    return _state.lib is not None, str(_state.reason)


def native_isa() -> str | None:
    return native_isa_name(_state.isa, _state.avx_vnni) if native_status()[0] else None


def isa_level() -> int:
    """The instruction set the int4 kernel's calls take here (2: AVX512-VNNI, 1: AVX2; 0: no kernel)."""
    return _state.isa if native_status()[0] else 0


def function_address(name: str) -> int:
    """The address of the int4 library's C function ``name``, for native code that calls it itself
    (``fate_edge.model.decode_layer``)."""
    return ctypes.cast(getattr(_lib(), name), ctypes.c_void_p).value or 0


def rows_of_four_pay() -> bool:
    """Whether matrices kept for a whole run go into rows of four (:meth:`NativeInt4.interleave_rows`) here: where the
    kernel runs AVX-512, on which it was measured (docs/measured-choices.md). The AVX2 kernel reads either layout,
    rows of four four rows at a time, but gained nothing from them where it was measured (an AVX-512 host made to
    run it, docs/cpu-profile.md): AVX2 hosts keep the portable layout until one of them measures otherwise."""
    return native_status()[0] and _state.isa == 2


def native_is_default() -> bool:
    """Whether stored int4 codes compute on this kernel by default: wherever it runs (AVX512-VNNI or AVX2), where
    it was faster than torch's int4 kernel at every row count measured (docs/measured-choices.md)."""
    return native_isa() is not None


def _lib() -> ctypes.CDLL:
    """The loaded library (built on first use), or a RuntimeError saying why there is none."""
    ok, why = native_status()
    if not ok:
        raise RuntimeError(f"the native int4 kernel is not available: {why}")
    assert _state.lib is not None  # native_status said it is loaded
    return _state.lib


def q4_0_codes(blocks: torch.Tensor) -> torch.Tensor | None:
    """llama.cpp q4_0 blocks (contiguous uint8, 18 bytes a block) → their codes packed in the portable layout
    (uint8, 16 bytes a block), in C: the GGUF convert's main CPU cost in torch, longer than the disk's read
    (docs/measured-choices.md). None where the library is not available (the caller repacks in torch)."""
    if not native_status()[0] or blocks.dtype != torch.uint8 or not blocks.is_contiguous() or blocks.numel() % 18:
        return None
    n = blocks.numel() // 18
    out = torch.empty(n * 16, dtype=torch.uint8)
    _lib().fe_q4_0_codes(blocks.data_ptr(), n, out.data_ptr())
    return out


def set_gemm_min_rows(rows: int) -> int:
    """From how many x rows on the kernel takes its register-tiled GEMM (below it, the row kernel, which streams
    weights fastest at one row); 0 restores the per-instruction-set default (3 rows on AVX-512, 8 on AVX2).
    Returns the previous setting; for tests and kernel benchmarks that compare the two paths."""
    lib = _lib()
    before = _state.gemm_min_rows
    lib.fe_int4_set_gemm_min_rows(rows)
    _state.gemm_min_rows = rows
    return before


def padded_in_features(k: int) -> int:
    """K as the kernel holds it: the next multiple of 128 (its chunk of codes)."""
    return k + -k % 128


def native_supports(shape: tuple[int, int], group_size: int, asymmetric: bool, pad: bool = False) -> bool:
    """Whether the kernel takes an [N, K] matrix in these groups (of 32, 64 or 128): on its own bytes where K is a
    multiple of 128; with ``pad``, also a K of whole groups that :func:`padded_in_features` pads by at most an eighth
    (a copy with zero columns: for weights quantized in memory, which are a copy anyway; DeepSeek-V2-Lite's dense
    down_proj, K = 10944, gains 0.6%; the bundled model's K = 192 would gain a third and stays on torch's kernel)."""
    k = shape[1]
    fits = k % 128 == 0 or (pad and k % group_size == 0 and 8 * (padded_in_features(k) - k) <= k)
    return asymmetric and fits and group_size in (32, 64, 128) and native_status()[0]


@dataclass
class NativeInt4:
    """``x [M, K] -> x @ W.T`` for W = codes * scale + zero (portable layout: ``codes`` [N, K/2] two per byte,
    low nibble first; ``scale`` and ``zero`` [N, K/g], fp16 or fp32: the kernel reads either as stored, so fp32 ones,
    a GGUF's q4_K scales which fp16 would round, stay exact; a pair in other or mixed dtypes is converted, to fp32
    where either is fp32, else to fp16). The tensors may be views into an expert's blob."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group_size: int
    in_features: int = 0  # K of x; 0: the codes' own. Columns past it (padding to a multiple of 128) are zero
    rows4: bool = False  # codes in rows of four (interleave_rows), not the portable layout
    # fe_int4_gemm's first seven arguments (the matrix's own), built once: a call adds x's and y's
    _fixed: list[int] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _lib()  # builds the library on first use, whoever constructs the matrix
        for name in ("codes", "scale", "zero"):
            t = getattr(self, name)
            if not t.is_contiguous():
                setattr(self, name, t.contiguous())
        if self.scale.dtype != self.zero.dtype or self.scale.dtype not in (torch.float16, torch.float32):
            wide = torch.float32 in (self.scale.dtype, self.zero.dtype)  # never round an fp32 part to fp16
            dtype = torch.float32 if wide else torch.float16
            self.scale, self.zero = self.scale.to(dtype), self.zero.to(dtype)
        k = self.codes.shape[1] * 2
        self.in_features = self.in_features or k
        pad = padded_in_features(k) - k  # zero codes with zero scale and zero add nothing
        if pad and self.rows4:
            raise ValueError(f"codes in rows of four are already padded: K {k} is not a multiple of 128")
        if pad:
            n, g = self.codes.shape[0], self.group_size
            self.codes = torch.cat([self.codes, self.codes.new_zeros(n, pad // 2)], dim=1)
            self.scale = torch.cat([self.scale, self.scale.new_zeros(n, pad // g)], dim=1)
            self.zero = torch.cat([self.zero, self.zero.new_zeros(n, pad // g)], dim=1)
        self._set_fixed()

    def _set_fixed(self) -> None:
        self._fixed = [
            self.codes.data_ptr(),
            self.scale.data_ptr(),
            self.zero.data_ptr(),
            int(self.scale.dtype == torch.float32) | (2 if self.rows4 else 0),  # fe_int4_gemm's flags
            self.codes.shape[0],
            self.codes.shape[1] * 2,
            self.group_size,
        ]

    # A copy (pickle, deepcopy) holds new tensors: their addresses, never the original's
    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_fixed"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._set_fixed()

    @property
    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """codes, scale, zero in the portable layout (padded columns included: see :attr:`in_features`): the codes
        themselves, or a portable copy where they are in rows of four (:meth:`interleave_rows`)."""
        if not self.rows4:
            return self.codes, self.scale, self.zero
        codes = self.codes.clone()
        _rows4(codes, False)
        return codes, self.scale, self.zero

    def interleave_rows(self) -> None:
        """The codes rewritten in place in rows of four (``code_at`` in ``native/int4_gemm.c``): each four rows' 64-byte
        chunks side by side, so the one-row kernel streams one run of memory where it read four rows 1 KB apart; the
        same products, the same bits. For matrices kept for the whole run (a resident model's): the codes must be
        writable and no one else may read them as the portable layout (:attr:`parts` gives that layout back)."""
        if self.rows4:
            return
        _rows4(self.codes, True)
        self.rows4 = True
        self._set_fixed()

    @property
    def shape(self) -> tuple[int, int]:
        return self._fixed[4], self.in_features  # the codes' rows, kept with the call's arguments

    def own_args(self) -> list[int]:
        """fe_int4_gemm's seven arguments of the matrix's own, then the K of its x: what native code that builds the
        calls itself needs (``fate_edge.model.decode_layer``)."""
        return [*self._fixed, self.in_features]

    def call_args(self, x: torch.Tensor, y: torch.Tensor) -> list[int]:
        """fe_int4_gemm's arguments for ``y = x @ W.T`` (x, y contiguous [M, K] / [M, N], both bf16 or both fp32):
        one row of :func:`gemm_grouped`'s table."""
        bf16 = int(x.dtype == torch.bfloat16)
        return [*self._fixed, x.data_ptr(), bf16, self.in_features, x.shape[0], y.data_ptr(), bf16]

    def bf16_args(self, x: int, rows: int, y: int) -> list[int]:
        """:meth:`call_args` from addresses: bf16 x [rows, K] at ``x``, y [rows, N] at ``y`` (both contiguous)."""
        return [*self._fixed, x, 1, self.in_features, rows, y, 1]

    def gemm_bf16(self, x: int, rows: int, y: int) -> None:
        """``y = x @ W.T`` on addresses: bf16 x [rows, K] at ``x`` into bf16 y [rows, N] at ``y``, both contiguous,
        the bits of :meth:`__call__`. Unchecked: the caller holds both alive (a decode row's attention, whose
        fixed shapes were checked once: ``fate_edge.model.attention_row``)."""
        self._gemm(self.bf16_args(x, rows, y))

    def _gemm(self, args: list[int]) -> None:
        """``fe_int4_gemm`` on a row of arguments (:meth:`call_args`, :meth:`bf16_args`), at torch's threads."""
        lib = _state.lib
        assert lib is not None  # loaded in __post_init__
        if lib.fe_int4_gemm(*args, torch.get_num_threads(), _state.isa) != 0:
            n, k, rows = self.shape[0], self.in_features, args[10]  # M is the row's 11th field (fe_int4_gemm's order)
            raise MemoryError(f"native int4 matmul {n}x{k} on {rows} rows: out of memory for its buffers")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.codes.shape[0], self.in_features
        x2 = x.reshape(-1, k)
        if x2.dtype not in (torch.float32, torch.bfloat16):
            x2 = x2.to(torch.float32)
        x2 = x2.contiguous()
        bf16 = x2.dtype == torch.bfloat16  # the kernel reads and writes bf16 itself: no conversions around it
        # On x's device, whatever the default device is (under ``torch.device("meta")`` a bare empty() would hand the
        # kernel a tensor without storage to write into)
        y = torch.empty(x2.shape[0], n, dtype=torch.bfloat16 if bf16 else torch.float32, device=x2.device)
        if x2.shape[0]:
            self._gemm(self.call_args(x2, y))
        y = y if x.dim() == 2 else y.view(*x.shape[:-1], n)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))


def _rows4(codes: torch.Tensor, to_rows4: bool) -> None:
    """``codes`` [N, K/2] (contiguous uint8) rewritten in place into rows of four, or back."""
    assert codes.dtype == torch.uint8 and codes.dim() == 2 and codes.is_contiguous() and codes.device.type == "cpu"
    if _lib().fe_int4_rows4(codes.data_ptr(), codes.shape[0], codes.shape[1] * 2, int(to_rows4)) != 0:
        raise MemoryError(f"int4 codes {tuple(codes.shape)}: no memory to reorder their rows")


def gemm_grouped(calls: list[tuple[NativeInt4, torch.Tensor, torch.Tensor]]) -> None:
    """``y = x @ W.T`` for every (matrix, x, y) in one call into the kernel, the threads sharing out whole matrices
    (a MoE layer's experts on their own rows: one parallel region instead of one per matrix). x and y: contiguous
    [M, K] / [M, N] views, both bf16 or both fp32, M > 0; each y is written in place, with the bits
    :meth:`NativeInt4.__call__` gives (a matrix is computed the same way whichever thread takes it)."""
    if not calls:
        return
    for lin, x, y in calls:
        n, k = lin.shape
        if x.dim() != 2 or x.shape[1] != k or not x.is_contiguous() or not y.is_contiguous():
            raise ValueError(f"gemm_grouped: x {tuple(x.shape)} for a {n}x{k} matrix must be a contiguous [M, {k}]")
        if y.shape != (x.shape[0], n) or y.dtype != x.dtype or x.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"gemm_grouped: y {tuple(y.shape)} {y.dtype} does not fit x {tuple(x.shape)} {x.dtype}")
    table = array.array("q", [a for lin, x, y in calls for a in lin.call_args(x, y)])  # int64, as the C reads
    address, _ = table.buffer_info()
    rc = _lib().fe_int4_gemm_grouped(len(calls), address, torch.get_num_threads(), _state.isa)
    if rc != 0:
        raise MemoryError(f"native int4 grouped matmul of {len(calls)} matrices: out of memory for its buffers")


_silu_table: list[torch.Tensor] = []


def silu_table() -> torch.Tensor:
    """torch's bf16 ``silu`` of every bf16 value as int16 bits, indexed by the input's bits (and one entry more: the
    kernel's gathers read 4 bytes): the activation :func:`glu_grouped` computes has torch's bits by
    construction. torch's bf16 silu of a value is the same wherever the value sits in a tensor (checked for all
    65,536 at several offsets, tests/test_native_glu.py), so a table of single values stands for any tensor's."""
    if not _silu_table:
        with _lock:
            if not _silu_table:
                every = torch.arange(65536, dtype=torch.int32, device="cpu").to(torch.int16).view(torch.bfloat16)
                bits = torch.nn.functional.silu(every).view(torch.int16)
                _silu_table.append(torch.cat([bits, bits.new_zeros(1)]).contiguous())
    return _silu_table[0]


def glu_grouped(first: list[int], glu: list[int], down: list[int]) -> None:
    """A MoE layer's SiLU-gated experts in one call into the kernel (``fe_int4_glu_grouped``): :func:`gemm_grouped`'s
    table ``first`` (each expert's gate and up, one matrix or two: rows of :meth:`NativeInt4.bf16_args`), then per
    expert six integers of ``glu`` (where its gate and up start, their row stride, the intermediate size I, the rows
    M, where its activation goes: [M, I] contiguous), ``act = silu(gate) * up`` in bf16, then ``down``'s table (x:
    the activations). The bits of :func:`gemm_grouped` twice with torch's ``F.silu(gate) * up`` between. Unchecked:
    the caller builds every address from tensors it holds alive through the call
    (``fate_edge.model.grouped_experts``)."""
    if not first or not glu or not down or len(first) % 13 or len(glu) % 6 or len(down) % 13:
        raise ValueError("glu_grouped: whole rows of 13 (matrices) and 6 (activations) integers, none empty")
    tables = [array.array("q", rows) for rows in (first, glu, down)]  # int64, as the C reads
    rc = _lib().fe_int4_glu_grouped(
        len(first) // 13,
        tables[0].buffer_info()[0],
        len(glu) // 6,
        tables[1].buffer_info()[0],
        len(down) // 13,
        tables[2].buffer_info()[0],
        silu_table().data_ptr(),
        torch.get_num_threads(),
        _state.isa,
    )
    if rc != 0:
        raise MemoryError(f"native int4 SiLU-gated experts ({len(down) // 13}): out of memory for the kernel's buffers")
