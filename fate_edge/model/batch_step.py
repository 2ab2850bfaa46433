"""One forward pass over several sequences at once, each with its own KV cache (continuous batching).

The rows of every sequence (a decode token, or a chunk of a joining prompt) are stacked into one [N, H] activation,
so every linear, norm, router and routed expert runs once for the whole batch: the MoE block
(:mod:`fate_edge.model.routed_experts`) groups the rows by expert (``dispatch.group_by_expert``) and asks the
expert provider for the union of the batch's experts once, most wanted first. Only attention is per sequence, and
even that is the one attention function (``attention.gqa`` or ``mla.mla``) over one state, :class:`BatchState`: its
update writes each sequence's rows into its own cache and hands back the parts, each attended by its own kind. The
layer is the one layer function (:func:`~fate_edge.model.layer_step.decoder_layer`): there is no second copy of the
model math.

Where the decode tokens' caches share a :class:`~fate_edge.model.kv_slab.KVSlab`, they are one part
(``kv_slab.SlabRows``): their keys and values go in with one ``index_copy_`` and, while their caches are short
(``attention.GATHER_MAX`` positions), attend with one masked attention per layer over their ranges gathered side by
side (bf16 on the CPU: one native call over the ranges in place; MLA: absorbed, in one pass); longer ones attend per
sequence over views of the slab (a gather would copy more than the per-sequence calls cost). Prompt chunks attend
per sequence, and so does a sliding-window layer (each sequence keeps its own window's end, outside the slab).
A recurrent layer (short convolution, DeltaNet) steps the decode rows' states together, stacked
(``kv_cache.RecurrentLayer.step_rows``): one convolution and one delta-rule call for all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fate_edge.model.embedding import lookup
from fate_edge.model.kv_cache import AttentionState, Held, Keys, RecurrentLayer
from fate_edge.model.kv_slab import SlabCache, SlabRows
from fate_edge.model.layer import LayerPlan, head_logits, rms_norm
from fate_edge.model.layer_step import LayerPath, add_projection, decoder_layer
from fate_edge.model.recurrent import mix
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
    if len(segments) == 1:  # a batch of one: the model's own forward (its one-token step, or a prompt, last logits)
        seg = segments[0]
        if len(seg.ids) == 1:  # written on the device by a fill kernel: no host-to-device copy (and wait) per token
            ids = torch.full((1, 1), seg.ids[0], dtype=torch.long, device=model.device)
            return model(ids, seg.cache)[:, -1]
        return model(torch.tensor([seg.ids], device=model.device), seg.cache, last_only=True)[:, -1]
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
    state = BatchState(segments, bounds, dev)
    model.experts.begin_forward(max(lengths), sequences=len(segments))
    model.residual = None
    prune = rows > len(segments) and not any(getattr(o, "needs_every_token", True) for o in model.observers)
    last = len(plan) - 1

    def attend(x: torch.Tensor, h: torch.Tensor, i: int, lp: LayerPlan) -> torch.Tensor:
        out = mix(cfg, h, 1, rows, i, lp, state, cos, sin)  # attention, or a recurrent mixer
        x = add_projection(x, out, lp.o_proj)
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
    return head_logits(x, model.head)


class BatchState(AttentionState):
    """A step's sequences as one state: an update writes each sequence's rows (the step's rows of every segment, in
    order) into its own cache, a slab's decode rows all at once (``kv_slab.SlabRows``, first), and hands back the
    parts for the attention to serve each by its kind. A recurrent layer's decode rows step their states as one
    (stacked), unless ``stack_recurrent`` is False: each alone, the reference the stacked step is tested and timed
    against."""

    stack_recurrent = True

    def __init__(self, segments: list[Segment], bounds: list[tuple[int, int]], device: torch.device):
        self.caches = [s.cache for s in segments]
        self.bounds = bounds
        dec = [j for j, s in enumerate(segments) if len(s.ids) == 1 and isinstance(s.cache, SlabCache)]
        slab = [c for c in (segments[j].cache for j in dec) if isinstance(c, SlabCache)]
        rows = SlabRows.of(slab, [bounds[j][0] for j in dec], len(dec) == len(segments), device)
        self.together = rows
        self.rest = [j for j in range(len(segments)) if rows is None or j not in dec]
        # every decode row, whatever its cache: a recurrent layer steps their states as one (stacked)
        self.one_row = [j for j, (a, b) in enumerate(bounds) if b - a == 1]
        every = len(self.one_row) == len(segments)
        self.one_row_sel: slice | torch.Tensor = (
            slice(0, len(segments)) if every else torch.tensor([bounds[j][0] for j in self.one_row], device=device)
        )

    def update(self, layer: int, *new: torch.Tensor) -> Held:
        """``new``: every row's k and v [1, kv heads, rows, d] (or MLA's latent, or a recurrent layer's inputs)."""
        lay = self.caches[0].layers[layer]
        if isinstance(lay, RecurrentLayer):  # a state per sequence, never a slab's rows
            return self._recurrent(layer, new[0])
        if lay.window is not None:  # a sliding window's end is each sequence's own too
            return Held(parts=self._each(layer, range(len(self.caches)), new))
        parts: list[tuple[slice | torch.Tensor, Keys]] = []
        d = self.together
        if d is not None:
            mine = new if d.every_row else tuple(x.index_select(2, d.rows) for x in new)
            parts.append((slice(0, new[0].shape[2]) if d.every_row else d.rows, d.update(layer, *mine)))
        parts += self._each(layer, self.rest, new)
        return Held(parts=parts)

    def _each(self, layer: int, which, new: tuple[torch.Tensor, ...]) -> list[tuple[slice | torch.Tensor, Keys]]:
        """Sequences ``which``, each updating its own state with its rows."""
        out: list[tuple[slice | torch.Tensor, Keys]] = []
        for j in which:
            a, b = self.bounds[j]
            out.append((slice(a, b), self.caches[j].update(layer, *(x[:, :, a:b] for x in new))))
        return out

    def _recurrent(self, layer: int, x: torch.Tensor) -> Held:
        """A recurrent layer's inputs ``x`` [1, channels, rows]: the decode rows' states stepped as one
        (``RecurrentLayer.step_rows``, first), each prompt chunk from its own state."""
        if len(self.one_row) < 2 or not self.stack_recurrent:
            return Held(parts=self._each(layer, range(len(self.caches)), (x,)))
        sel = self.one_row_sel
        states = [st for st in (self.caches[j].layers[layer] for j in self.one_row) if isinstance(st, RecurrentLayer)]
        mine = x if isinstance(sel, slice) else x.index_select(2, sel)
        stacked = RecurrentLayer.step_rows(states, mine.permute(2, 1, 0))  # the rows as a batch [S, channels, 1]
        rest = [j for j in range(len(self.caches)) if self.bounds[j][1] - self.bounds[j][0] != 1]
        return Held(parts=[(sel, stacked), *self._each(layer, rest, (x,))])
