"""A layer's routed experts for one token in one Triton launch, reading the store's portable int4 blobs in place.

The experts lie in device slots as the store holds them (``format.store``'s portable layout: packed codes, low
nibble first, [N, K/2]; a scale and a zero per group of K, fp16 or fp32, [N, K/g]): nothing is re-packed when an
expert arrives. One launch computes the token's k experts, ``down(silu(gate(x)) * up(x))``, and their weighted sum.

The grid is (k experts, blocks of the intermediate rows). A program computes its block of the expert's gate and up
rows (float32), the SwiGLU, and that block's share of the down projection, a float32 partial of all H outputs
written to a scratch row. The last program to finish (a counter: ``atomic_add`` after a barrier) sums the
partials: each expert's blocks in block order, then the experts in the order given, expert-id order, into a
float32 accumulator from zero, ``acc += w_e * y_e``: the summing rule every path keeps (docs/architecture.md §1,
``layer_step.add_routed``). It resets the counter, so a CUDA graph can replay the launch.

Per group of g codes a row's dot product is ``scale * Σ c·x + zero * Σ x`` (symmetric specs: ``scale * (Σ c·x -
2^(b-1) Σ x)``): the stored numbers, one multiply per group for scale and zero. Tested on the CPU under Triton's
interpreter (``TRITON_INTERPRET=1``, tests/test_triton_moe.py) against dequantize-then-matmul at small shapes;
its speed on a GPU is not measured yet (docs/gpu.md).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch

try:  # optional: Triton is a GPU dependency (the test extra carries it for the interpreter)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None
    tl = None

MATRICES = ("gate", "up", "down")


def triton_available() -> bool:
    return triton is not None


@dataclass(frozen=True)
class Int4MoELayout:
    """Where each part of a portable int4 expert blob lies (byte offsets), and the shapes the kernel needs."""

    hidden: int
    inter: int
    group: int
    slot_bytes: int  # distance between two slots of the slab
    offsets: tuple[int, ...]  # codes, scale, zero of gate, up, down (zero: 0 where the spec is symmetric)
    scale_fp32: bool
    symmetric_offset: int  # 0 for asymmetric specs; 2^(bits-1) where w = (c - 2^(bits-1)) * scale

    @classmethod
    def of(cls, precision: Any, slot_bytes: int | None = None) -> Int4MoELayout:
        """The layout of a store precision (``format.store.Precision``); raises ValueError for another layout."""
        spec = precision.spec
        if spec is None or precision.layout != "portable" or spec.storage_bits != 4:
            raise ValueError(
                f"the Triton int4 MoE kernel reads portable blobs of 4-bit codes, not {precision.layout} "
                f"int{precision.bits}; convert with --layout portable"
            )
        parts = {p.name: p for p in precision.parts}
        inter, half = parts["gate.codes"].shape
        hidden = half * 2
        group = spec.group_size
        if hidden % group or inter % group or group % 2:
            raise ValueError(f"expert {inter}x{hidden} is not whole groups of {group}")
        offsets = []
        for m in MATRICES:
            zero = parts.get(f"{m}.zero")
            offsets += [parts[f"{m}.codes"].offset, parts[f"{m}.scale"].offset, zero.offset if zero else 0]
        return cls(
            hidden,
            inter,
            group,
            slot_bytes or precision.slot_bytes,
            tuple(offsets),
            precision.scale_dtype == "float32",
            0 if spec.asymmetric else 1 << (spec.bits - 1),
        )


def _body(
    x_ptr,
    slab_ptr,
    slots_ptr,
    w_ptr,
    part_ptr,
    count_ptr,
    out_ptr,
    k,
    slot_bytes,
    GATE_C: tl.constexpr,
    GATE_S: tl.constexpr,
    GATE_Z: tl.constexpr,
    UP_C: tl.constexpr,
    UP_S: tl.constexpr,
    UP_Z: tl.constexpr,
    DOWN_C: tl.constexpr,
    DOWN_S: tl.constexpr,
    DOWN_Z: tl.constexpr,
    H: tl.constexpr,
    INTER: tl.constexpr,
    G: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SYM: tl.constexpr,
    SCALE_FP32: tl.constexpr,
):
    e = tl.program_id(0)
    ib = tl.program_id(1)
    n_ib = INTER // BLOCK_I
    sdtype = tl.float32 if SCALE_FP32 else tl.float16
    slot = tl.load(slots_ptr + e).to(tl.int64)
    base = slab_ptr + slot * slot_bytes
    pair = tl.arange(0, BLOCK_I // 2)
    even = ib * BLOCK_I + 2 * pair  # intermediate rows: a byte of down's codes holds an even and an odd column
    odd = even + 1
    cols = tl.arange(0, G // 2)  # bytes of one group of a row

    # gate and up rows of this block, float32, one group of H at a time: scale * Σ c·x + zero * Σ x
    ge = tl.zeros([BLOCK_I // 2], dtype=tl.float32)
    go = tl.zeros([BLOCK_I // 2], dtype=tl.float32)
    ue = tl.zeros([BLOCK_I // 2], dtype=tl.float32)
    uo = tl.zeros([BLOCK_I // 2], dtype=tl.float32)
    for hg in range(H // G):
        xe = tl.load(x_ptr + hg * G + 2 * cols).to(tl.float32)
        xo = tl.load(x_ptr + hg * G + 2 * cols + 1).to(tl.float32)
        xs = tl.sum(xe, axis=0) + tl.sum(xo, axis=0)
        byte = hg * (G // 2) + cols[None, :]
        ge += _group_dot(base, GATE_C, GATE_S, GATE_Z, even, byte, hg, xe, xo, xs, H, G, SYM, sdtype)
        go += _group_dot(base, GATE_C, GATE_S, GATE_Z, odd, byte, hg, xe, xo, xs, H, G, SYM, sdtype)
        ue += _group_dot(base, UP_C, UP_S, UP_Z, even, byte, hg, xe, xo, xs, H, G, SYM, sdtype)
        uo += _group_dot(base, UP_C, UP_S, UP_Z, odd, byte, hg, xe, xo, xs, H, G, SYM, sdtype)
    ae = ge * tl.sigmoid(ge) * ue  # silu(gate) * up
    ao = go * tl.sigmoid(go) * uo
    asum = tl.sum(ae, axis=0) + tl.sum(ao, axis=0)

    # this block's share of down for every output row: its columns lie in one group of INTER
    dgroup = (ib * BLOCK_I) // G
    dbyte = ib * (BLOCK_I // 2) + pair[None, :]
    row = part_ptr + (e * n_ib + ib) * H
    for hb in range(H // BLOCK_H):
        h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        y = _group_dot(base, DOWN_C, DOWN_S, DOWN_Z, h, dbyte, dgroup, ae, ao, asum, INTER, G, SYM, sdtype)
        tl.store(row + h, y)

    # the last program to finish sums every partial: blocks in order, experts in the order given (expert-id order)
    tl.debug_barrier()
    done = tl.atomic_add(count_ptr, 1)
    if done == k * n_ib - 1:
        for hb in range(H // BLOCK_H):
            h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
            acc = tl.zeros([BLOCK_H], dtype=tl.float32)
            for ee in range(k):
                y = tl.zeros([BLOCK_H], dtype=tl.float32)
                for jb in range(n_ib):
                    y += tl.load(part_ptr + (ee * n_ib + jb) * H + h, cache_modifier=".cg")
                acc += tl.load(w_ptr + ee).to(tl.float32) * y
            tl.store(out_ptr + h, acc)
        tl.store(count_ptr, 0)  # ready for the next launch (a replayed graph reuses the counter)


def _group_dot_body(
    base,
    C: tl.constexpr,
    S: tl.constexpr,
    Z: tl.constexpr,
    rows,
    byte,
    grp,
    ve,
    vo,
    vsum,
    K: tl.constexpr,
    G: tl.constexpr,
    SYM: tl.constexpr,
    sdtype: tl.constexpr,
):
    """Rows ``rows`` of a matrix [N, K] at one group ``grp`` of K: scale * Σ c·v + zero * Σ v, float32."""
    codes = tl.load(base + C + rows[:, None] * (K // 2) + byte)  # [R, G/2] uint8, low nibble first
    lo = (codes & 15).to(tl.float32)
    hi = (codes >> 4).to(tl.float32)
    dot = tl.sum(lo * ve[None, :] + hi * vo[None, :], axis=1)
    scale = tl.load((base + S).to(tl.pointer_type(sdtype)) + rows * (K // G) + grp).to(tl.float32)
    if SYM:
        return scale * (dot - SYM * vsum)
    zero = tl.load((base + Z).to(tl.pointer_type(sdtype)) + rows * (K // G) + grp).to(tl.float32)
    return scale * dot + zero * vsum


_group_dot: Any = None  # triton.jit(_group_dot_body), made with the kernel (_kernel)


@functools.cache
def _kernel(interpret: bool) -> Any:
    """The kernel, made for the interpreter or the GPU as ``TRITON_INTERPRET`` says when first used (Triton reads
    it when a function is decorated)."""
    assert triton is not None
    global _group_dot
    _group_dot = triton.jit(_group_dot_body)
    return triton.jit(_body)


@dataclass
class MoEScratch:
    """The kernel's working memory: the partial rows, the finish counter (the last program resets it to 0, so it is
    zeroed once), and the output."""

    part: torch.Tensor  # [k * INTER / block_i, H] float32
    count: torch.Tensor  # [1] int32, 0 between launches
    out: torch.Tensor  # [H] float32

    @classmethod
    def for_layout(cls, layout: Int4MoELayout, k: int, block_i: int, device: torch.device) -> MoEScratch:
        rows = k * (layout.inter // block_i)
        return cls(
            torch.empty(rows, layout.hidden, dtype=torch.float32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device),
            torch.empty(layout.hidden, dtype=torch.float32, device=device),
        )


def moe_int4(
    x: torch.Tensor,
    slab: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    layout: Int4MoELayout,
    block_i: int | None = None,
    block_h: int = 64,
    scratch: MoEScratch | None = None,
) -> torch.Tensor:
    """One token's routed experts: ``Σ_e weights[e] · expert_e(x)`` in float32 [H], the experts read from
    ``slab`` (uint8, slot ``slots[e]`` at ``slots[e] * layout.slot_bytes``) in place.

    ``x`` [H] (any float dtype), ``slots`` and ``weights`` [k] in expert-id order (the sum follows it).
    ``block_i``: intermediate rows a program computes (divides the group; default the group, at most 64).
    ``scratch``: buffers kept from call to call (a captured graph's: the launch is then the only kernel), else new."""
    if triton is None:
        raise RuntimeError("the Triton int4 MoE kernel needs triton; install fate-edge[test] or triton")
    h, inter, g = layout.hidden, layout.inter, layout.group
    block_i = block_i or min(g, 64)
    block_h = min(block_h, h)
    if g % block_i or h % block_h or x.numel() != h:
        raise ValueError(f"blocks {block_i}/{block_h} do not tile the expert {inter}x{h} (group {g})")
    k = slots.numel()
    n_ib = inter // block_i
    scratch = scratch or MoEScratch.for_layout(layout, k, block_i, x.device)
    part, count, out = scratch.part, scratch.count, scratch.out
    if part.shape[0] < k * n_ib or out.numel() != h:
        raise ValueError(f"scratch for {part.shape[0]} partial rows of {out.numel()}, need {k * n_ib} of {h}")
    kernel = _kernel(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))
    kernel[(k, n_ib)](
        x.contiguous(),
        slab,
        slots.to(torch.int64),
        weights.to(torch.float32),
        part,
        count,
        out,
        k,
        layout.slot_bytes,
        *layout.offsets,
        H=h,
        INTER=inter,
        G=g,
        BLOCK_I=block_i,
        BLOCK_H=block_h,
        SYM=layout.symmetric_offset,
        SCALE_FP32=layout.scale_fp32,
    )
    return out
