"""One forward pass over several sequences at once, each with its own KV cache (continuous batching).

The rows of every sequence (a decode token, or a chunk of a joining prompt) are stacked into one [N, H] activation,
so every linear, norm, router and routed expert runs once for the whole batch: the MoE block
(:meth:`MoETransformer._moe`) groups the rows by expert (``dispatch.group_by_expert``) and asks the expert provider
for the union of the batch's experts once, most wanted first. Only attention is per sequence: each segment's keys
and values go to its own cache and its queries attend over its own positions. The pieces are the transformer's own
(``gqa_qkv``, ``_attend``, ``_moe``, ``_mlp``): there is no second copy of the model math.

MLA attention (DeepSeek) keeps its latent per sequence in a way this step does not slice: :func:`supported`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fate_edge.model.embedding import lookup
from fate_edge.model.layer import apply_linear, rms_norm

if TYPE_CHECKING:
    from fate_edge.model.kv_cache import KVCache
    from fate_edge.model.transformer import MoETransformer


@dataclass
class Segment:
    """One sequence's rows in a batched step: ``ids`` continue ``cache`` (one id when decoding)."""

    ids: list[int]
    cache: KVCache


def supported(model: MoETransformer) -> str | None:
    """None when ``model`` can run batched steps, else why not."""
    if model.config.mla is not None:
        return "MLA attention (its latent cache is not sliced per sequence)"
    return None


@torch.inference_mode()
def forward_segments(model: MoETransformer, segments: list[Segment]) -> torch.Tensor:
    """Every segment's rows in one pass → logits [S, V] of each segment's last position."""
    why = supported(model)
    if why is not None:
        raise NotImplementedError(f"batched steps do not support {why}")
    if not segments or any(not s.ids for s in segments):
        raise ValueError("a batched step needs at least one segment and one id per segment")
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
    model.experts.begin_forward(max(lengths), sequences=len(segments))
    model.residual = None
    prune = rows > len(segments) and not any(getattr(o, "needs_every_token", True) for o in model.observers)
    x = lookup(model.embed, ids)  # [N, H]
    eps = cfg.rms_norm_eps
    try:
        for i, lp in enumerate(plan):
            h = rms_norm(x, lp.input_norm, eps)
            a = _attention(model, h, segments, bounds, starts, i, cos, sin, lp)
            if prune and i == len(plan) - 1:  # past the last attention only each segment's last row feeds a logit
                x, a = x.index_select(0, ends), a.index_select(0, ends)
            x = x + a
            h = rms_norm(x, lp.post_norm, eps)
            if lp.router is not None:
                model.residual = x
                x = x + model._moe(h, i, lp)
            else:
                x = x + model._mlp(h, lp.mlp, lp.down)
    finally:
        model.residual = None
    if not prune or len(plan) == 0:
        x = x.index_select(0, ends)
    x = rms_norm(x, model.w["model.norm.weight"], eps)
    return apply_linear(x, model.head)


def _attention(model: MoETransformer, h: torch.Tensor, segments: list[Segment], bounds: list[tuple[int, int]],
               starts: list[int], layer: int, cos: torch.Tensor, sin: torch.Tensor, lp) -> torch.Tensor:
    """q, k, v for all rows in one projection; each segment's keys into its cache and its queries over them."""
    q, k, v = model.gqa_qkv(h, 1, h.shape[0], cos, sin, lp)  # [1, heads, N, hd]
    scale = model.config.head_dim**-0.5
    outs = []
    for seg, (a, b), start in zip(segments, bounds, starts):
        keys, values = seg.cache.layers[layer].append(k[:, :, a:b], v[:, :, a:b],
                                                      capacity_hint=seg.cache.capacity_hint)
        outs.append(model._attend(q[:, :, a:b], keys, values, start, layer, scale))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return apply_linear(out, lp.o_proj)
