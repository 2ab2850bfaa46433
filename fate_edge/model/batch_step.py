"""One forward pass over several sequences at once, each with its own KV cache (continuous batching).

The rows of every sequence (a decode token, or a chunk of a joining prompt) are stacked into one [N, H] activation,
so every linear, norm, router and routed expert runs once for the whole batch: the MoE block
(:mod:`fate_edge.model.routed_experts`) groups the rows by expert (``dispatch.group_by_expert``) and asks the
expert provider for the union of the batch's experts once, most wanted first. Only attention is per sequence: each
segment's keys and values go to its own cache and its queries attend over its own positions. The layer is the one
layer function (:func:`~fate_edge.model.layer_step.decoder_layer`) with the transformer's own ``gqa_qkv`` and
``_attend``: there is no second copy of the model math.

Where the sequences' caches share a :class:`~fate_edge.model.kv_slab.KVSlab`, the decode tokens of a step write
their keys and values with one ``index_copy_`` and, while their caches are short (:data:`GATHER_MAX` positions),
attend with one masked attention per layer over their ranges gathered side by side; longer ones attend per
sequence over views of the slab (a gather would copy more than the per-sequence calls cost). Prompt chunks attend
per sequence.

MLA attention (DeepSeek) projects every row at once too; each sequence then caches its latent and attends over its
own cache (:func:`_mla_attention`), as it would alone (a decode row in the latent space: ``MoETransformer.mla_attend``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fate_edge.model import decode_attention, head_matvec, sdpa
from fate_edge.model.embedding import lookup
from fate_edge.model.kv_slab import SlabCache
from fate_edge.model.layer import LayerPlan, apply_linear, rms_norm
from fate_edge.model.layer_step import LayerPath, add_projection, decoder_layer
from fate_edge.model.routed_experts import provider_moe

if TYPE_CHECKING:
    from fate_edge.model.kv_cache import KVCache
    from fate_edge.model.transformer import MoETransformer


@dataclass
class Segment:
    """One sequence's rows in a batched step: ``ids`` continue ``cache`` (one id when decoding)."""

    ids: list[int]
    cache: KVCache


@torch.inference_mode()
def forward_segments(model: MoETransformer, segments: list[Segment]) -> torch.Tensor:
    """Every segment's rows in one pass → logits [S, V] of each segment's last position."""
    if not segments or any(not s.ids for s in segments):
        raise ValueError("a batched step needs at least one segment and one id per segment")
    if len(segments) == 1 and len(segments[0].ids) == 1:  # one decode token: the single-sequence decode step
        seg = segments[0]
        return model(torch.tensor([seg.ids], device=model.device), seg.cache)[:, -1]
    cfg, dev = model.config, model.device
    plan = model.plan()
    lengths = [len(s.ids) for s in segments]
    starts = [s.cache.length for s in segments]
    bounds, at = [], 0
    for n in lengths:
        bounds.append((at, at + n))
        at += n
    rows = at
    ends = torch.tensor([b - 1 for _, b in bounds], device=dev)
    ids = torch.tensor([i for s in segments for i in s.ids], device=dev)
    rope_dtype = torch.float32 if cfg.rope.float32 else model.dtype
    parts = [model.rope.cos_sin_range(p, n, rope_dtype, dev) for p, n in zip(starts, lengths)]
    cos = torch.cat([c for c, _ in parts]) if len(parts) > 1 else parts[0][0]
    sin = torch.cat([s for _, s in parts]) if len(parts) > 1 else parts[0][1]
    decode = _SlabDecode.of(segments, bounds, starts, dev)
    model.experts.begin_forward(max(lengths), sequences=len(segments))
    model.residual = None
    prune = rows > len(segments) and not any(getattr(o, "needs_every_token", True) for o in model.observers)
    last = len(plan) - 1

    def attend(x: torch.Tensor, h: torch.Tensor, i: int, lp: LayerPlan) -> torch.Tensor:
        x = add_projection(x, _attention(model, h, segments, bounds, starts, i, cos, sin, lp, decode), lp.o_proj)
        # past the last attention only each segment's last row feeds a logit
        return x.index_select(0, ends) if prune and i == last else x

    # which rows are decode tokens (layer_step.expert_rows): all, none, or a prompt chunk beside decode tokens
    decoding = rows == len(segments)
    every: bool | torch.Tensor = decoding
    last_rows: bool | torch.Tensor = decoding
    if not decoding and any(n == 1 for n in lengths):
        mask = torch.tensor([n == 1 for n in lengths for _ in range(n)], device=dev)
        every, last_rows = mask, mask.index_select(0, ends) if prune else mask
    moe_every, moe_last = provider_moe(model, every), provider_moe(model, last_rows)

    def moe(x: torch.Tensor, h: torch.Tensor, i: int, lp: LayerPlan, w: torch.Tensor, idx: torch.Tensor):
        return (moe_last if i == last else moe_every)(x, h, i, lp, w, idx)

    path = LayerPath(cfg, model.act, attend, moe)
    x = lookup(model.embed, ids)  # [N, H]
    try:
        for i, lp in enumerate(plan):
            x = decoder_layer(path, x, i, lp)
    finally:
        model.residual = None
    if not prune or len(plan) == 0:
        x = x.index_select(0, ends)
    x = rms_norm(x, model.w["model.norm.weight"], cfg.rms_norm_eps)
    return apply_linear(x, model.head)


GATHER_MAX = 256  # longest decode cache whose keys a step gathers for one attention (else one call per sequence)


class _SlabDecode:
    """A step's decode rows whose caches share one slab: where each writes, and which slab positions each sees."""

    def __init__(
        self,
        segs: list[int],
        rows: torch.Tensor,
        positions: torch.Tensor,
        first: torch.Tensor,
        lengths: list[int],
        every_row: bool,
    ):
        self.segs = segs  # indices of the decode segments
        self.rows = rows  # [S] their rows in the step
        self.positions = positions  # [S] the slab position each writes
        self.first = first  # [S] the first slab position of each one's range
        self.lengths = lengths  # each one's cache length after this step
        self.longest = max(lengths)
        self.every_row = every_row  # the step is decode only, rows in segment order
        self._masks: dict[int | None, torch.Tensor] = {}
        self._ranges: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def of(
        cls, segments: list[Segment], bounds: list[tuple[int, int]], starts: list[int], device: torch.device
    ) -> _SlabDecode | None:
        caches = {j: s.cache for j, s in enumerate(segments) if len(s.ids) == 1 and isinstance(s.cache, SlabCache)}
        dec = list(caches)
        if len(dec) < 2 or len({id(c.slab) for c in caches.values()}) != 1:
            return None
        offsets = [caches[j].offset for j in dec]
        slab = caches[dec[0]].slab
        # a range's last gathered position may run past the slab's end when it is the last range: clamp
        if max(offsets) + max(starts[j] + 1 for j in dec) > slab.positions:
            return None
        pos = [o + starts[j] for o, j in zip(offsets, dec)]
        rows = [bounds[j][0] for j in dec]
        return cls(
            dec,
            torch.tensor(rows, device=device),
            torch.tensor(pos, device=device),
            torch.tensor(offsets, device=device),
            [starts[j] + 1 for j in dec],
            len(dec) == len(segments),
        )

    @functools.cached_property
    def gather(self) -> torch.Tensor:
        """[S * longest] slab positions of each range's first ``longest`` positions (past its own end: masked); made
        only for the gathered attention (the native kernel and MLA's rows read their ranges in place)."""
        return (self.first[:, None] + torch.arange(self.longest, device=self.first.device)[None, :]).flatten()

    def ranges(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """([S] first slab position, [S] count) of the positions each row sees (its last ``window``), int64 on the
        host: the native decode attention reads them in place, no gather and no mask."""
        r = self._ranges.get(window)
        if r is None:
            n = torch.tensor(self.lengths, dtype=torch.int64, device="cpu")  # the kernel reads them on the host
            seen = n if window is None else n.clamp(max=window)
            r = self._ranges[window] = (self.first.to("cpu", torch.int64) + n - seen, seen)
        return r

    def mask(self, window: int | None) -> torch.Tensor:
        """[S, 1, 1, longest]: row j sees its own first ``lengths[j]`` positions (the last ``window`` of them)."""
        m = self._masks.get(window)
        if m is None:
            key = torch.arange(self.longest, device=self.positions.device)[None, :]
            n = torch.tensor(self.lengths, device=key.device)[:, None]
            m = key < n
            if window is not None:
                m &= key >= n - window
            self._masks[window] = m = m[:, None, None, :]
        return m


def _attention(
    model: MoETransformer,
    h: torch.Tensor,
    segments: list[Segment],
    bounds: list[tuple[int, int]],
    starts: list[int],
    layer: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    lp,
    decode: _SlabDecode | None,
) -> torch.Tensor:
    """q, k, v for all rows in one projection; each segment's keys into its cache and its queries over them (a
    slab's decode rows all at once) → the attention's output before its projection [N, heads * head_dim]."""
    if model.config.mla is not None:
        return _mla_attention(model, h, segments, bounds, starts, layer, cos, sin, lp, decode)
    q, k, v = model.gqa_qkv(h, 1, h.shape[0], cos, sin, lp)  # [1, heads, N, hd]
    scale = model.config.head_dim**-0.5
    together = None if decode is None else (decode, _slab_attention(model, q, k, v, segments, layer, scale, decode))

    def one(seg: Segment, a: int, b: int, start: int) -> torch.Tensor:
        keys, values = seg.cache.layers[layer].append(k[:, :, a:b], v[:, :, a:b], capacity_hint=seg.cache.capacity_hint)
        return model._attend(q[:, :, a:b], keys, values, start, layer, scale)

    return _with_the_rest(h.shape[0], segments, bounds, starts, together, one)


def _with_the_rest(
    rows: int,
    segments: list[Segment],
    bounds: list[tuple[int, int]],
    starts: list[int],
    together: tuple[_SlabDecode, torch.Tensor] | None,
    one: Callable[[Segment, int, int, int], torch.Tensor],
) -> torch.Tensor:
    """A step's attention output [rows, width]: the slab's decode rows computed ``together`` (None: none were) in
    their places, every other segment from ``one(segment, first row, end row, start position)``."""
    out, done = None, set()
    if together is not None:
        d, y = together
        if d.every_row:
            return y
        out = y.new_empty(rows, y.shape[1])
        out.index_copy_(0, d.rows, y)
        done = set(d.segs)
    outs = []
    for j, (seg, (a, b), start) in enumerate(zip(segments, bounds, starts)):
        if j in done:
            continue
        y = one(seg, a, b, start)
        if out is None:
            outs.append(y)
        else:
            out[a:b] = y
    return out if out is not None else torch.cat(outs) if len(outs) > 1 else outs[0]


def _mla_attention(
    model: MoETransformer,
    h: torch.Tensor,
    segments: list[Segment],
    bounds: list[tuple[int, int]],
    starts: list[int],
    layer: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    lp: LayerPlan,
    decode: _SlabDecode | None,
) -> torch.Tensor:
    """MLA: q and the latent for all rows in one projection; the slab's decode rows in one pass where the CPU
    kernels take them (:func:`_mla_slab_decode`), every other segment's latent into its cache and its queries over
    it (``mla_attend``) → [N, heads * v_head_dim]."""
    q, latent = model.mla_qkv(h, 1, h.shape[0], cos, sin, layer, lp)
    dec = None if decode is None else _mla_slab_decode(model, q, latent, segments, layer, lp, decode)
    together = None if decode is None or dec is None else (decode, dec)

    def one(seg: Segment, a: int, b: int, start: int) -> torch.Tensor:
        (held,) = seg.cache.layers[layer].append(latent[:, :, a:b], capacity_hint=seg.cache.capacity_hint)
        return model.mla_attend(q[:, :, a:b], held, start, layer, lp)

    return _with_the_rest(h.shape[0], segments, bounds, starts, together, one)


def _mla_slab_decode(
    model: MoETransformer,
    q: torch.Tensor,
    latent: torch.Tensor,
    segments: list[Segment],
    layer: int,
    lp: LayerPlan,
    d: _SlabDecode,
) -> torch.Tensor | None:
    """The decode rows of MLA caches in one slab, absorbed (``mla_attend``'s form) in one pass: their latents into
    the slab with one copy, every row's query through each head's key block of ``kv_b_proj`` with the block read
    once (``head_matvec``), one attention over the rows' own ranges, one pass through the value blocks → [S, heads *
    v_head_dim], each row as it decodes alone. None (nothing written) where the CPU kernels do not take them."""
    m = model.config.mla
    assert m is not None
    kv_b = lp.mla["kv_b_proj"]
    first = segments[d.segs[0]].cache
    assert isinstance(first, SlabCache)  # _SlabDecode.of took only slab caches
    (held,) = first.slab.buffers[layer]  # [1, 1, positions, r + rope]
    r, heads = m.kv_lora_rank, q.shape[1]
    if not isinstance(kv_b.weight, torch.Tensor) or kv_b.bias is not None:
        return None
    wk, wv = model.mla_blocks(kv_b.weight, heads)
    cache = held[0]  # [1, positions, r + rope]: MLA's one key "head"
    probe = q.new_empty(1, heads, r + m.qk_rope_head_dim)
    if not (head_matvec.takes(wk) and decode_attention.takes_ranges(probe, cache, cache[..., :r])):
        return None
    rows_q = (q[0] if d.every_row else q[0].index_select(1, d.rows)).transpose(0, 1)  # [S, heads, nope + rope]
    new = latent[0, 0] if d.every_row else latent[0, 0].index_select(0, d.rows)  # [S, r + rope]
    cache[0].index_copy_(0, d.positions, new)
    for j in d.segs:
        segments[j].cache.layers[layer].length += 1
    q_lat = model.mla_latent_queries(rows_q, wk)  # [S, heads, r + rope]
    o = decode_attention.attend_ranges(q_lat, cache, cache[..., :r], *d.ranges(None), model.mla_scale())
    return model.mla_latent_values(o, wv)


def _slab_attention(
    model: MoETransformer,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: list[Segment],
    layer: int,
    scale: float,
    d: _SlabDecode,
) -> torch.Tensor:
    """The decode rows' keys and values into the slab in one copy each, and their attention in one call → [S, nh*hd]."""
    cfg = model.config
    first = segments[d.segs[0]].cache
    assert isinstance(first, SlabCache)  # _SlabDecode.of took only slab caches
    slab = first.slab
    ks, vs = slab.buffers[layer]
    if d.every_row:
        qd, kd, vd = q, k[0], v[0]
    else:
        qd, kd, vd = q.index_select(2, d.rows), k[0].index_select(1, d.rows), v[0].index_select(1, d.rows)
    ks[0].index_copy_(1, d.positions, kd)
    vs[0].index_copy_(1, d.positions, vd)
    for j in d.segs:
        segments[j].cache.layers[layer].length += 1
    window = cfg.sliding_window if layer in cfg.sliding_window_layers else None
    s, gqa = qd.shape[2], qd.shape[1] != ks.shape[1]
    rows = qd[0].transpose(0, 1)  # [S, nh, hd]
    if decode_attention.takes_ranges(rows, ks[0], vs[0]):  # bf16/fp16 on the CPU: each row over its own range
        return decode_attention.attend_ranges(rows, ks[0], vs[0], *d.ranges(window), scale).reshape(s, -1)
    if d.longest > GATHER_MAX:  # one call per sequence over its own view of the slab
        outs = []
        for i, j in enumerate(d.segs):
            layer_cache = segments[j].cache.layers[layer]
            keys, values = (b[:, :, : layer_cache.length] for b in layer_cache.buffers)
            if window is not None:
                keys, values = keys[:, :, -window:], values[:, :, -window:]
            outs.append(sdpa.attention(qd[:, :, i : i + 1], keys, values, scale=scale, enable_gqa=gqa))
        return torch.cat(outs, dim=2)[0].transpose(0, 1).reshape(s, -1)
    nkv, hd = ks.shape[1], ks.shape[3]
    keys = ks[0].index_select(1, d.gather).view(nkv, s, d.longest, hd).transpose(0, 1)  # [S, nkv, longest, hd]
    values = vs[0].index_select(1, d.gather).view(nkv, s, d.longest, -1).transpose(0, 1)
    out = sdpa.attention(
        qd.permute(2, 1, 0, 3), keys, values, attn_mask=d.mask(window), scale=scale, enable_gqa=gqa
    )  # [S, nh, 1, hd]
    return out.reshape(s, -1)
