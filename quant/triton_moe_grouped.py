"""A prompt's routed experts for one layer in two Triton launches, reading the store's portable int4 blobs in place.

Prefill (grouped): the (token, expert) pairs of a layer are sorted by expert id on the device (one stable
``argsort``), so each expert's rows are contiguous; a tile table (expert, first row, end row: blocks of
``block_m`` rows of one expert) is built on the device too, sized by an upper bound the host knows from the
shapes (pairs / block_m + experts), so nothing waits on the GPU. Then two launches over (tile, block):

1. gate and up for a tile's rows and a block of the intermediate rows, as ``tl.dot`` of the rows' even and odd
   columns with an expert's low and high nibbles per group, scaled per group (``scale * Σ c·x + zero * Σ x``,
   float32), and the SwiGLU → the activations [pairs, I] float32;
2. down for a tile's rows and a block of H → the expert outputs [pairs, H] float32.

The outputs go back to their (token, rank) places in expert-id order, for the caller to sum each token's experts
by :func:`~fate_edge.model.layer_step.add_routed` in float32 (k passes, pass j adding every token's j-th expert by
id): the rule every path keeps. Tiles past the last hold no rows and do nothing.

The layout is ``triton_moe``'s (:class:`~fate_edge.quant.triton_moe.Int4MoELayout`): the experts lie in slots of
a slab, ``slot_of[e]`` the slot of the layer's expert ``e``. Tested on the CPU under Triton's interpreter
(tests/test_grouped_prefill.py) against dequantize-then-matmul; its speed on a GPU is not measured (docs/gpu.md).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from fate_edge.quant.triton_moe import Int4MoELayout, triton_available

try:  # optional: Triton is a GPU dependency (the test extra carries it for the interpreter)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None
    tl = None


def _gate_up_body(
    x_ptr,
    act_ptr,
    slab_ptr,
    slot_of_ptr,
    tile_e_ptr,
    tile_a_ptr,
    tile_b_ptr,
    slot_bytes,
    GATE_C: tl.constexpr,
    GATE_S: tl.constexpr,
    GATE_Z: tl.constexpr,
    UP_C: tl.constexpr,
    UP_S: tl.constexpr,
    UP_Z: tl.constexpr,
    H: tl.constexpr,
    INTER: tl.constexpr,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_I: tl.constexpr,
    SYM: tl.constexpr,
    SCALE_FP32: tl.constexpr,
):
    t = tl.program_id(0)
    ib = tl.program_id(1)
    a = tl.load(tile_a_ptr + t)
    b = tl.load(tile_b_ptr + t)
    if a < b:
        sdtype = tl.float32 if SCALE_FP32 else tl.float16
        slot = tl.load(slot_of_ptr + tl.load(tile_e_ptr + t)).to(tl.int64)
        base = slab_ptr + slot * slot_bytes
        rows = a + tl.arange(0, BLOCK_M)
        live = rows < b
        irow = ib * BLOCK_I + tl.arange(0, BLOCK_I)
        j = tl.arange(0, G // 2)
        gate = tl.zeros([BLOCK_M, BLOCK_I], dtype=tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_I], dtype=tl.float32)
        for hg in range(H // G):
            xcol = x_ptr + rows[:, None] * H + hg * G + 2 * j[None, :]
            xe = tl.load(xcol, mask=live[:, None], other=0.0)
            xo = tl.load(xcol + 1, mask=live[:, None], other=0.0)
            xs = tl.sum(xe, axis=1) + tl.sum(xo, axis=1)
            byte = hg * (G // 2) + j[None, :]
            gate += _tile_dot(base, GATE_C, GATE_S, GATE_Z, irow, byte, hg, xe, xo, xs, H, G, SYM, sdtype)
            up += _tile_dot(base, UP_C, UP_S, UP_Z, irow, byte, hg, xe, xo, xs, H, G, SYM, sdtype)
        act = gate * tl.sigmoid(gate) * up  # silu(gate) * up
        tl.store(act_ptr + rows[:, None] * INTER + irow[None, :], act, mask=live[:, None])


def _down_body(
    act_ptr,
    y_ptr,
    slab_ptr,
    slot_of_ptr,
    tile_e_ptr,
    tile_a_ptr,
    tile_b_ptr,
    slot_bytes,
    DOWN_C: tl.constexpr,
    DOWN_S: tl.constexpr,
    DOWN_Z: tl.constexpr,
    H: tl.constexpr,
    INTER: tl.constexpr,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SYM: tl.constexpr,
    SCALE_FP32: tl.constexpr,
):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    a = tl.load(tile_a_ptr + t)
    b = tl.load(tile_b_ptr + t)
    if a < b:
        sdtype = tl.float32 if SCALE_FP32 else tl.float16
        slot = tl.load(slot_of_ptr + tl.load(tile_e_ptr + t)).to(tl.int64)
        base = slab_ptr + slot * slot_bytes
        rows = a + tl.arange(0, BLOCK_M)
        live = rows < b
        hrow = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        j = tl.arange(0, G // 2)
        y = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
        for ig in range(INTER // G):
            acol = act_ptr + rows[:, None] * INTER + ig * G + 2 * j[None, :]
            ae = tl.load(acol, mask=live[:, None], other=0.0)
            ao = tl.load(acol + 1, mask=live[:, None], other=0.0)
            asum = tl.sum(ae, axis=1) + tl.sum(ao, axis=1)
            byte = ig * (G // 2) + j[None, :]
            y += _tile_dot(base, DOWN_C, DOWN_S, DOWN_Z, hrow, byte, ig, ae, ao, asum, INTER, G, SYM, sdtype)
        tl.store(y_ptr + rows[:, None] * H + hrow[None, :], y, mask=live[:, None])


def _tile_dot_body(
    base,
    C: tl.constexpr,
    S: tl.constexpr,
    Z: tl.constexpr,
    wrows,
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
    """Input rows (``ve``/``vo``: their even and odd columns of group ``grp`` of K, [M, G/2]) times weight rows
    ``wrows`` of a matrix [N, K] at that group → [M, len(wrows)] float32: scale * Σ c·v + zero * Σ v."""
    codes = tl.load(base + C + wrows[:, None] * (K // 2) + byte)  # [R, G/2] uint8, low nibble first
    lo = (codes & 15).to(tl.float32)
    hi = (codes >> 4).to(tl.float32)
    dot = tl.dot(ve, tl.trans(lo), input_precision="ieee") + tl.dot(vo, tl.trans(hi), input_precision="ieee")
    scale = tl.load((base + S).to(tl.pointer_type(sdtype)) + wrows * (K // G) + grp).to(tl.float32)
    if SYM:
        return scale[None, :] * (dot - SYM * vsum[:, None])
    zero = tl.load((base + Z).to(tl.pointer_type(sdtype)) + wrows * (K // G) + grp).to(tl.float32)
    return scale[None, :] * dot + zero[None, :] * vsum[:, None]


_tile_dot: Any = None  # triton.jit(_tile_dot_body), made with the kernels (_kernels)


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """The two kernels, made when first used (Triton reads ``TRITON_INTERPRET`` when a function is decorated)."""
    assert triton is not None
    global _tile_dot
    _tile_dot = triton.jit(_tile_dot_body)
    return triton.jit(_gate_up_body), triton.jit(_down_body)


def expert_tiles(
    experts_sorted: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tile table of pairs sorted by expert (``experts_sorted`` [P] ascending), built on its device without a
    host sync: (expert, first row, end row) per tile, ``P // block_m + num_experts`` tiles (an upper bound on the
    tiles the experts' row counts need), the spare ones empty (first row = end row = 0)."""
    dev, p = experts_sorted.device, experts_sorted.numel()
    counts = torch.bincount(experts_sorted, minlength=num_experts)
    seg_end = counts.cumsum(0)
    seg_start = seg_end - counts
    tiles = (counts + block_m - 1) // block_m
    tile_end = tiles.cumsum(0)
    t = torch.arange(p // block_m + num_experts, device=dev)
    e = torch.searchsorted(tile_end, t, right=True)
    live = e < num_experts
    e = e.clamp(max=num_experts - 1)
    first = seg_start[e] + (t - (tile_end[e] - tiles[e])) * block_m
    end = torch.minimum(first + block_m, seg_end[e])
    zero = torch.zeros_like(first)
    return torch.where(live, e, 0), torch.where(live, first, zero), torch.where(live, end, zero)


def moe_prefill_int4(
    h: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    slab: torch.Tensor,
    slot_of: torch.Tensor,
    layout: Int4MoELayout,
    block_m: int = 16,
    block_i: int | None = None,
    block_h: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``h`` [N, H] routed to ``idx`` [N, k] with ``weights`` [N, k] → (each row's expert outputs [N, k, H]
    float32, in expert-id order; their weights [N, k] float32 in the same order), for the caller to sum by
    ``layer_step.add_routed``. The layer's expert ``e`` is read from slot ``slot_of[e]`` of ``slab`` (uint8
    [slots, slot_bytes]). ``block_i`` (intermediate rows a program computes) divides the group; ``block_m``,
    ``block_i`` and ``block_h`` are at least 16 (``tl.dot``)."""
    if not triton_available():
        raise RuntimeError("the grouped Triton int4 MoE kernels need triton; install fate-edge[test] or triton")
    n, k = idx.shape
    hidden, inter, g = layout.hidden, layout.inter, layout.group
    block_i = block_i or min(g, 64)
    block_h = min(block_h, hidden)
    if g % block_i or hidden % block_h or h.shape[1] != hidden or min(block_m, block_i, block_h, g // 2) < 16:
        raise ValueError(f"blocks {block_m}/{block_i}/{block_h} do not tile the expert {inter}x{hidden} (group {g})")
    flat = idx.flatten()
    order = flat.argsort(stable=True)  # pairs by expert id, tokens in order within: on the device
    tile_e, tile_a, tile_b = expert_tiles(flat.index_select(0, order), slot_of.numel(), block_m)
    x = h.index_select(0, order // k).float().contiguous()  # [P, H] each pair's input row
    act = torch.empty(n * k, inter, dtype=torch.float32, device=h.device)
    y = torch.empty(n * k, hidden, dtype=torch.float32, device=h.device)
    gate_up, down = _kernels()
    o = layout.offsets
    common = {"H": hidden, "INTER": inter, "G": g, "BLOCK_M": block_m}
    quant = {"SYM": layout.symmetric_offset, "SCALE_FP32": layout.scale_fp32}
    tiles = tile_e.numel()
    slots = slot_of.to(torch.int64)
    gate_up[(tiles, inter // block_i)](
        x, act, slab, slots, tile_e, tile_a, tile_b, layout.slot_bytes, *o[:6], **common, BLOCK_I=block_i, **quant
    )
    down[(tiles, hidden // block_h)](
        act, y, slab, slots, tile_e, tile_a, tile_b, layout.slot_bytes, *o[6:], **common, BLOCK_H=block_h, **quant
    )
    # back to (token, rank by expert id): the caller's pass j adds every token's j-th expert by id
    ys = torch.empty_like(y).index_copy_(0, order, y).view(n, k, hidden)
    by_id = idx.argsort(dim=1)
    return ys.gather(1, by_id[:, :, None].expand(n, k, hidden)), weights.float().gather(1, by_id)
