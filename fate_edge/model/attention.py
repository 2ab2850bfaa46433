"""Grouped-query attention, written once for every forward path: eager prompts and batches, the one-token decode
step, the compiled step and the CUDA graphs (MLA's is :mod:`fate_edge.model.mla`).

:func:`gqa` projects q, k and v, writes k and v through the layer's state (``state.update``: any
:class:`~fate_edge.model.kv_cache.AttentionState`) and attends over what the update hands back
(``kv_cache.Keys``). The paths differ only in that state, and :func:`attend` picks the kernel for its kind: a
sequence's prefix (torch's attention, causal or masked; a bf16 decode query in fate-edge's kernel
through ``sdpa``), a whole-capacity static buffer (two bmm and a masked softmax, which inductor fuses), a slab's
decode rows (one call over every row's own range), or a batch's parts (each part by its own kind).

Attention sinks (gpt-oss: ``LayerPlan.sinks``, a learned logit per head that joins every softmax's denominator
and weighs no value) are taken by every kind: bf16/fp16 decode queries on the CPU in fate-edge's kernel (its
softmax adds the sink), everything else through :func:`sink_attention`, the scores written out (torch's fused
kernels take no sink).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from fate_edge.model import decode_attention, row_ops, sdpa
from fate_edge.model.kv_cache import Held
from fate_edge.model.layer import LayerPlan, apply_linear, rms_norm
from fate_edge.model.rope import apply_rope
from fate_edge.model.row_ops import RopeRows

if TYPE_CHECKING:
    from fate_edge.model.arch.base import ModelConfig
    from fate_edge.model.kv_cache import AttentionState, Keys, RowRanges

GATHER_MAX = 256  # longest decode range whose keys a slab step gathers for one attention (else one call per row)


def gqa(
    cfg: ModelConfig,
    h: torch.Tensor,
    b: int,
    t: int,
    layer: int,
    lp: LayerPlan,
    state: AttentionState,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rot: torch.Tensor | RopeRows | None = None,
) -> torch.Tensor:
    """Normed ``h`` [B*T, H] → the attention's output before its projection [B*T, heads * head_dim], k and v
    written through ``state`` (``rot``: one decode token's rope as a matrix, :func:`gqa_qkv`)."""
    if cfg.attn_output_gate:  # Qwen3-Next: sigmoid(gate) times each head's output
        gate: list[torch.Tensor] = []
        q, k, v = gqa_qkv(cfg, h, b, t, cos, sin, lp, gate_out=gate)
        out = attend(cfg, q, state.update(layer, k, v), layer, cfg.head_dim**-0.5)
        return out * torch.sigmoid(gate[0].reshape(out.shape))
    q, k, v = gqa_qkv(cfg, h, b, t, cos, sin, lp, rot) if rot is None else _rotated_qkv(cfg, h, lp, rot)
    return attend(cfg, q, state.update(layer, k, v), layer, cfg.head_dim**-0.5, lp.sinks)


def gqa_qkv(
    cfg: ModelConfig,
    x: torch.Tensor,
    b: int,
    t: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    lp: LayerPlan,
    rot: torch.Tensor | RopeRows | None = None,
    gate_out: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normed ``x`` [B*T, H] → q [B, heads, T, hd], k and v [B, kv heads, T, hd], q and k rotated (also what
    predictors/early_attention.py runs a layer early on).

    ``rot`` [d, d] (one token of one sequence, no clipping, a per-head q/k norm or none: ``decode_step.supported``):
    rope as one small matmul over q and k together (``decode_step.rope_matrix``), the fewest operators a decode token
    can take."""
    if rot is not None:
        return _rotated_qkv(cfg, x, lp, rot)
    hd = cfg.head_dim
    assert lp.qkv is not None  # GQA layers have one
    qkv = apply_linear(x, lp.qkv)
    n_q, n_k = lp.qkv.sizes[0] // hd, lp.qkv.sizes[1] // hd
    if cfg.qk_norm == "none" and cfg.clip_qkv is None and not cfg.attn_output_gate:  # rotate q and k in one pass
        qk = qkv[..., : (n_q + n_k) * hd].view(b, t, n_q + n_k, hd).transpose(1, 2)
        qk = apply_rope(qk, cos, sin, cfg.rope.interleaved)
        q, k = qk[:, :n_q], qk[:, n_q:]
        v = qkv[..., (n_q + n_k) * hd :]
    else:
        q, k, v = qkv.split(lp.qkv.sizes, dim=-1) if len(lp.qkv.sizes) > 1 else [qkv]
        if cfg.attn_output_gate:  # each head's query, then its output gate (``gate_out`` gets the gates)
            q, gate = q.reshape(b, t, -1, 2 * hd).chunk(2, dim=-1)
            assert gate_out is not None, "a gated attention's caller takes its gate"
            gate_out.append(gate.reshape(b * t, -1))
        if cfg.qk_norm == "full":  # OLMoE: one norm over all heads
            assert lp.q_norm is not None and lp.k_norm is not None
            q = rms_norm(q, lp.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, lp.k_norm, cfg.rms_norm_eps)
        if cfg.clip_qkv is not None:
            q, k, v = (z.clamp(-cfg.clip_qkv, cfg.clip_qkv) for z in (q, k, v))
        q = q.view(b, t, -1, hd)
        k = k.view(b, t, -1, hd)
        if cfg.qk_norm == "head":  # Qwen3: per-head norm
            assert lp.q_norm is not None and lp.k_norm is not None
            q = rms_norm(q, lp.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, lp.k_norm, cfg.rms_norm_eps)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, heads, T, hd]
        q, k = apply_rope(q, cos, sin, cfg.rope.interleaved), apply_rope(k, cos, sin, cfg.rope.interleaved)
    v = v.reshape(b, t, -1, hd).transpose(1, 2)
    return q, k, v


def _rotated_qkv(
    cfg: ModelConfig, x: torch.Tensor, lp: LayerPlan, rot: torch.Tensor | RopeRows
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`gqa_qkv` for one token of one sequence with its rope as a matrix ``rot``."""
    hd = cfg.head_dim
    assert lp.qkv is not None  # GQA layers have one
    n_q, n_k = lp.qkv.sizes[0] // hd, lp.qkv.sizes[1] // hd
    w, bias = lp.qkv.weight, lp.qkv.bias
    head_norm = cfg.qk_norm == "head"
    # a quantized projection's bf16 bias: added in the native rope's call (the same rounding as ``y + bias``); not
    # where a per-head norm comes between them
    late = isinstance(rot, RopeRows) and bias is not None and not isinstance(w, torch.Tensor) and not head_norm
    late_bias = bias if late and bias is not None and bias.dtype == torch.bfloat16 and bias.is_contiguous() else None
    flat = (w(x) if late_bias is not None else apply_linear(x, lp.qkv)).view(-1)  # [(nq + 2 nk) hd]
    # narrow, not [a:b]: a slice costs over twice narrow's dispatch (four a layer, every token; measured-choices)
    qk = flat.narrow(0, 0, (n_q + n_k) * hd).view(n_q + n_k, hd)
    if head_norm:  # Qwen3: each head normed (gqa_qkv's bits: torch norms a row of heads as each row alone), then rope
        assert lp.q_norm is not None and lp.k_norm is not None
        eps = cfg.rms_norm_eps
        qk = torch.cat(
            [rms_norm(qk.narrow(0, 0, n_q), lp.q_norm, eps), rms_norm(qk.narrow(0, n_q, n_k), lp.k_norm, eps)]
        )
    if isinstance(rot, RopeRows) and qk.dtype == torch.bfloat16:  # in place on the projection's own output
        qk = row_ops.rope_(qk, rot, (flat, late_bias) if late_bias is not None else None)
    elif isinstance(rot, RopeRows):  # a float32 bias made the projection float32: the elementwise rope
        qk = apply_rope(qk.view(1, -1, 1, hd), rot.cos.to(qk.dtype), rot.sin.to(qk.dtype), False).view(-1, hd)
    else:
        qk = qk @ rot if rot.dtype == qk.dtype else torch.mm(qk.float(), rot).to(qk.dtype)
    q = qk.narrow(0, 0, n_q).view(1, n_q, 1, hd)
    k = qk.narrow(0, n_q, n_k).view(1, n_k, 1, hd)
    return q, k, flat.narrow(0, (n_q + n_k) * hd, n_k * hd).view(1, n_k, 1, hd)


def attend(
    cfg: ModelConfig, q: torch.Tensor, held: Keys, layer: int, scale: float, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """q [B, heads, T, dk] over what a state update handed back → [B*T, heads * dv], by the kind of state
    (``sinks`` [heads]: attention sinks, each head's logit in its softmax's denominator; None: none).

    A sequence's prefix (a plain tuple k, v [B, nkv, S, d]: its positions 0 .. S-1, the queries the last T of them)
    attends causally, over the last ``window`` positions on a sliding-window layer: one decode query over every
    held key (its window sliced, no mask), a whole prompt causally, a chunk after cached positions with a mask."""
    window = cfg.sliding_window if layer in cfg.sliding_window_layers else None
    if type(held) is tuple:  # the common kind first: no attribute to look up per decode layer
        k, v = held
        t, s = q.shape[2], k.shape[2]
        grouped = q.shape[1] != k.shape[1]
        if t == 1:
            if window is not None and s > window:
                k, v = k[:, :, s - window :], v[:, :, s - window :]
            if sinks is not None:
                if q.dtype in decode_attention.NATIVE_DTYPES and decode_attention.takes(q, k, v):  # bf16 on the CPU
                    return decode_attention.attend(q, k, v, scale, sinks).reshape(q.shape[0], -1)
                return sink_attention(q, k, v, scale, sinks).reshape(q.shape[0], -1)
            out = sdpa.attention(q, k, v, scale=scale, enable_gqa=grouped)
            return out.reshape(q.shape[0], -1)  # [B, nh, 1, d]: moving the size-1 axis moves no data
        if window is None and t == s and sinks is None:
            out = sdpa.attention(q, k, v, is_causal=True, scale=scale, enable_gqa=grouped)
        else:
            positions = torch.arange(s - t, s, device=q.device)
            key_pos = torch.arange(s, device=q.device)
            mask = key_pos[None, :] <= positions[:, None]
            if window is not None:
                mask &= key_pos[None, :] > positions[:, None] - window
            if sinks is not None:
                out = sink_attention(q, k, v, scale, sinks, mask)
            else:
                out = sdpa.attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=grouped)
        return out.transpose(1, 2).reshape(q.shape[0] * t, -1)
    assert isinstance(held, Held)
    if held.parts is not None:
        return over_parts(q, held, lambda qp, hp: attend(cfg, qp, hp, layer, scale, sinks))
    k, v = held.held
    if held.rows is not None:
        return _slab_rows(cfg, q, k, v, held.rows, layer, window, scale, sinks)
    assert held.mask is not None  # the last kind: a whole-capacity buffer
    return _static(q, k, v, held.mask, scale, sinks)


SINK_CHUNK_SCORES = 1 << 22  # float32 scores one sink_attention step holds (16 MB): a long prompt goes in row chunks


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sinks: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention whose softmax has one more logit per head, ``sinks`` [nh], that weighs no value (gpt-oss): q [B,
    nh, T, d] over k, v [B, nkv, S, d] (query head h reads kv head h // (nh / nkv)) where ``mask`` (broadcast to
    [B, nh, T, S]; None: every key) is True → [B, nh, T, dv]. Scores and softmax in float32, written out (no fused
    kernel takes a sink), so a long prompt's queries go in chunks of rows: at most :data:`SINK_CHUNK_SCORES` scores
    at once, where all of them for an 8k-token prompt of 64 heads would be 16 GB."""
    b, nh, t, _ = q.shape
    rows = max(1, SINK_CHUNK_SCORES // max(1, b * nh * k.shape[2]))
    if t <= rows:
        return _sink_rows(q, k, v, scale, sinks, mask)
    per_row = mask is not None and mask.dim() >= 2 and mask.shape[-2] == t  # else one mask row for every query
    out = []
    for a in range(0, t, rows):
        n = min(rows, t - a)
        part = mask.narrow(-2, a, n) if per_row and mask is not None else mask
        out.append(_sink_rows(q.narrow(2, a, n), k, v, scale, sinks, part))
    return torch.cat(out, dim=2)


def _sink_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sinks: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    b, nh, t, d = q.shape
    nkv, s = k.shape[1], k.shape[2]
    qg = q.reshape(b, nkv, (nh // nkv) * t, d)  # each kv head's query heads, one after another
    scores = torch.matmul(qg, k.transpose(-1, -2)).float().mul_(scale).view(b, nh, t, s)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    logits = torch.cat([scores, sinks.float().view(1, nh, 1, 1).expand(b, nh, t, 1)], dim=-1)
    p = logits.softmax(-1).narrow(-1, 0, s)  # the sink's share goes nowhere
    out = torch.matmul(p.to(v.dtype).reshape(b, nkv, -1, s), v)  # [B, nkv, g*T, dv]
    return out.view(b, nh, t, -1)


def _static(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, sinks: torch.Tensor | None
) -> torch.Tensor:
    """One query per head over a whole-capacity buffer (``mask`` [1, S]: the written positions): two bmm and a
    softmax inductor fuses with the mask (CPU flash attention and elementwise products and sums were slower at this
    size: docs/measured-choices.md)."""
    n_q, n_k, hd = q.shape[1], k.shape[1], q.shape[3]
    qg = q.reshape(n_k, n_q // n_k, hd)  # query heads grouped by their kv head
    scores = torch.bmm(qg, k[0].transpose(1, 2)) * scale  # [n_k, g, S]
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # one more logit per head in the denominator
        s = scores.shape[2]
        sink = sinks.to(scores.dtype).view(n_k, n_q // n_k, 1)
        p = torch.cat([scores, sink], dim=-1).softmax(-1).narrow(-1, 0, s)
    else:
        p = scores.softmax(-1)
    return torch.bmm(p, v[0]).view(1, n_q * v.shape[3])


def _slab_rows(
    cfg: ModelConfig,
    q: torch.Tensor,
    ks: torch.Tensor,
    vs: torch.Tensor,
    d: RowRanges,
    layer: int,
    window: int | None,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode query per sequence of a slab (``q`` [1, nh, S, hd], already the rows' own), each over its own
    range of the slab ``ks``/``vs`` [1, nkv, positions, hd] → [S, nh * hd]."""
    s, gqa = q.shape[2], q.shape[1] != ks.shape[1]
    rows = q[0].transpose(0, 1)  # [S, nh, hd]
    if decode_attention.takes_ranges(rows, ks[0], vs[0]):  # bf16/fp16 on the CPU: each row over its own range
        return decode_attention.attend_ranges(rows, ks[0], vs[0], *d.ranges(window), scale, sinks).reshape(s, -1)
    if d.longest > GATHER_MAX:  # one call per sequence over its own view of the slab (a gather would copy more)
        return torch.cat(
            [attend(cfg, q[:, :, i : i + 1], one, layer, scale, sinks) for i, one in enumerate(d.views(layer))]
        )
    nkv, hd = ks.shape[1], ks.shape[3]
    keys = ks[0].index_select(1, d.gather).view(nkv, s, d.longest, hd).transpose(0, 1)  # [S, nkv, longest, hd]
    values = vs[0].index_select(1, d.gather).view(nkv, s, d.longest, -1).transpose(0, 1)
    if sinks is not None:
        return sink_attention(q.permute(2, 1, 0, 3), keys, values, scale, sinks, d.mask(window)).reshape(s, -1)
    out = sdpa.attention(
        q.permute(2, 1, 0, 3), keys, values, attn_mask=d.mask(window), scale=scale, enable_gqa=gqa
    )  # [S, nh, 1, hd]
    return out.reshape(s, -1)


def over_parts(q: torch.Tensor, held: Held, attend_part: Callable[[torch.Tensor, Keys], torch.Tensor]) -> torch.Tensor:
    """A batch's attention output [rows, width] from its parts (``held.parts``: which rows of ``q`` [1, nh, rows,
    dk] each part's state serves, consecutive rows as a slice or, first, a slab's decode rows as an index tensor),
    each attended by its own kind."""
    assert held.parts is not None
    rows = q.shape[2]
    if len(held.parts) == 1 and held.parts[0][0] == slice(0, rows):
        return attend_part(q, held.parts[0][1])
    outs: list[torch.Tensor] = []
    out: torch.Tensor | None = None
    for sel, part in held.parts:
        if isinstance(sel, torch.Tensor):  # rows spread through the step: an output to place every part in
            y = attend_part(q.index_select(2, sel), part)
            out = y.new_empty(rows, y.shape[1])
            out.index_copy_(0, sel, y)
            continue
        y = attend_part(q[:, :, sel], part)
        if out is None:
            outs.append(y)
        else:
            out[sel] = y
    if out is not None:
        return out
    return torch.cat(outs) if len(outs) > 1 else outs[0]
