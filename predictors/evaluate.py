"""Measure expert predictors against real routing: collect traces, then score per layer.

Metrics (the ones docs/architecture.md §7 asks for; Fate, WWW'26, arXiv 2502.12224 reports the loose one):
* recall@k'  — share of the true top-k experts found among the predicted top-k' (k' ≥ k).
  Fate's "97% accuracy" is this with k' ≥ k; it is monotone non-decreasing in k'.
* exact      — predicted top-k set equals the true top-k set.
* wasted bytes — predicted-but-unused experts × bytes per expert: what a wrong prefetch reads for nothing.
Plus per-layer expert usage: entropy normalised by log E (1 = uniform) and the most-used expert's share.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from fate_edge.predictors.base import EMBEDDING, Predictor

from fate_edge.process_memory import release_freed_memory


@dataclass
class Trace:
    """Routing of the same N tokens through every MoE layer (rows align across layers)."""

    # MoE layer → [N, H] the router's input (or a previous_input.WidenedInputs: [N, (1-3)·H], built when read)
    gate_inputs: Mapping[int, torch.Tensor]
    expert_ids: dict[int, torch.Tensor]  # MoE layer → [N, k] experts the router chose
    num_experts: int
    token_ids: torch.Tensor | None = None  # [N] the input token of each row (collect_traces records it)
    # MoE layer i → [N, H] the next MoE layer's attention run early on i's residual (early_attention.py), when
    # collect_traces was asked for it
    early_inputs: dict[int, torch.Tensor] | None = None

    @property
    def layers(self) -> list[int]:
        return sorted(self.expert_ids)

    @property
    def tokens(self) -> int:
        return next(iter(self.expert_ids.values())).shape[0] if self.expert_ids else 0

    @property
    def top_k(self) -> int:
        return next(iter(self.expert_ids.values())).shape[1]

    def inputs(self, source: int) -> torch.Tensor | None:
        """What a predictor at ``source`` reads: its gate inputs [N, H], or the token ids [N] for EMBEDDING."""
        return self.token_ids if source == EMBEDDING else self.gate_inputs.get(source)

    def rows(self, start: int, stop: int | None = None) -> Trace:
        """The same trace restricted to rows ``start:stop`` (e.g. a contiguous validation tail)."""
        sl = slice(start, stop)
        lazy = getattr(self.gate_inputs, "rows", None)  # previous_input.WidenedInputs slices itself, lazily
        return Trace(
            lazy(start, stop) if lazy is not None else {i: h[sl] for i, h in self.gate_inputs.items()},
            {i: e[sl] for i, e in self.expert_ids.items()},
            self.num_experts,
            None if self.token_ids is None else self.token_ids[sl],
            None if self.early_inputs is None else {i: e[sl] for i, e in self.early_inputs.items()},
        )

    def popularity(self) -> dict[int, list[int]]:
        """MoE layer → how many rows routed to each expert."""
        return {
            i: torch.bincount(e.flatten(), minlength=self.num_experts).tolist()
            for i, e in sorted(self.expert_ids.items())
        }


class TraceRecorder:
    """A routing observer (append to ``model.observers``) that records gate inputs and chosen experts."""

    def __init__(self, num_experts: int, keep_inputs: bool = True, dtype: torch.dtype = torch.float32):
        self.num_experts = num_experts
        self.keep_inputs = keep_inputs
        self.dtype = dtype
        self._h: dict[int, list[torch.Tensor]] = {}
        self._ids: dict[int, list[torch.Tensor]] = {}

    def __call__(self, layer: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        self._ids.setdefault(layer, []).append(ids.detach().clone())
        if self.keep_inputs:
            self._h.setdefault(layer, []).append(h.detach().to(self.dtype, copy=True))

    def trace(self) -> Trace:
        """Everything recorded so far (the lists are joined once and kept joined, not held twice)."""
        for chunks in (self._h, self._ids):
            for i in chunks:  # one layer at a time: its chunks are freed as soon as they are joined
                chunks[i] = [torch.cat(chunks[i])]
        return Trace({i: v[0] for i, v in self._h.items()}, {i: v[0] for i, v in self._ids.items()}, self.num_experts)


def _as_float(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.is_floating_point() else x  # token ids stay integers


@torch.no_grad()
def collect_traces(
    model: Any, batches: Iterable[torch.Tensor], dtype: torch.dtype = torch.float32, early: bool = False
) -> Trace:
    """Run ``model`` (a :class:`fate_edge.model.transformer.MoETransformer`) over ``batches`` of token ids [B, T],
    each from an empty KV cache, and record every MoE layer's routing (gate inputs kept in ``dtype``)
    and the token ids (rows in the router's order: batch-major, then position). With ``early`` also the
    next MoE layer's attention run early on each layer's residual (``trace.early_inputs``, early_attention.py)."""
    from fate_edge.predictors.early_attention import ResidualRecorder, early_inputs_from_cache

    rec = TraceRecorder(model.config.num_experts, dtype=dtype)
    residuals = ResidualRecorder(model) if early else None
    tokens, parts = [], []
    added = [rec] + ([residuals] if residuals is not None else [])
    model.observers.extend(added)
    try:
        for n, ids in enumerate(batches, 1):
            if n % 32 == 0:
                release_freed_memory()  # else the heap keeps the freed temporaries: RSS ~2x the trace
            cache = model.new_cache()
            model(ids, cache, last_only=True)
            tokens.append(ids.reshape(-1))
            if residuals is not None:
                early_rows = early_inputs_from_cache(model, residuals.take(), cache)
                parts.append({i: e.to(dtype) for i, e in early_rows.items()})
    finally:
        for obs in added:
            model.observers.remove(obs)
    trace = rec.trace()
    trace.token_ids = torch.cat(tokens) if tokens else None
    if residuals is not None:
        # One layer at a time, dropping its chunks as they are joined: a long corpus is not held twice.
        trace.early_inputs = {i: torch.cat([p.pop(i) for p in parts]) for i in list(parts[0] if parts else {})}
    release_freed_memory()
    return trace


def _hits(pred: torch.Tensor, true: torch.Tensor) -> torch.Tensor:
    """pred [N, w], true [N, k] → bool [N, k]: is each true expert among the predicted ones."""
    return (pred[:, :, None] == true[:, None, :]).any(dim=1)


def recall_at(pred: torch.Tensor, true: torch.Tensor) -> float:
    """Mean share of each token's true experts found in its predicted set."""
    return _hits(pred, true).float().mean().item()


def exact_match(pred: torch.Tensor, true: torch.Tensor) -> float:
    """Share of tokens whose predicted top-k set equals the true top-k set (pred and true both [N, k])."""
    return _hits(pred, true).all(dim=1).float().mean().item()


@dataclass
class LayerAccuracy:
    """How well predictions made at ``source`` cover the experts routed at ``target``."""

    source: int
    target: int
    distance: int  # 1 = next MoE layer
    tokens: int
    exact: float
    recall: dict[int, float] = field(default_factory=dict)  # predicted width k' → recall@k'
    wasted_bytes: dict[int, float] = field(default_factory=dict)  # width k' → mean bytes per token read for nothing


def evaluate_predictor(
    predictor: Predictor,
    trace: Trace,
    widths: Iterable[int] | None = None,
    bytes_per_expert: int = 0,
    chunk: int = 4096,
    sources: Iterable[int] | None = None,
) -> list[LayerAccuracy]:
    """Score ``predictor`` on ``trace`` for every (source, target) pair it predicts; widths default to k..k+4.
    ``sources`` default to the trace's MoE layers; pass ``[EMBEDDING]`` for a token-id predictor."""
    k, e = trace.top_k, trace.num_experts
    widths = sorted({min(w, e) for w in (widths if widths is not None else range(k, k + 5))})
    if widths[0] < k:
        raise ValueError(f"widths must be >= top-k ({k}), got {widths}")
    wmax = widths[-1]
    out = []
    for src in trace.layers if sources is None else sources:
        targets = [t for t in predictor.targets(src) if t in trace.expert_ids]
        h = trace.inputs(src)
        if not targets or h is None:
            continue
        # top-wmax once; every narrower width is a prefix, which is what makes recall monotone in k'.
        # A trace may keep its gate inputs in half precision (calibrate does); predictors read float32.
        top = torch.cat(
            [predictor.predict(src, _as_float(h[s : s + chunk])).topk(wmax) for s in range(0, len(h), chunk)], dim=1
        )
        layers = predictor.targets(src)
        for target in targets:
            pred, true = top[layers.index(target)], trace.expert_ids[target]  # [N, wmax], [N, k]
            acc = LayerAccuracy(src, target, layers.index(target) + 1, len(true), exact_match(pred[:, :k], true))
            for w in widths:
                hits = _hits(pred[:, :w], true)
                acc.recall[w] = hits.float().mean().item()
                acc.wasted_bytes[w] = (w - hits.sum(dim=1).float()).mean().item() * bytes_per_expert
            out.append(acc)
    return out


@dataclass
class LayerUsage:
    layer: int
    entropy: float  # of the expert-usage distribution, / log E: 1.0 = perfectly balanced
    top_share: float  # share of routed slots taken by the most used expert (1/E when balanced)
    top_expert: int


def usage_stats(trace: Trace) -> list[LayerUsage]:
    """Per MoE layer: how evenly routing spreads over the experts."""
    out = []
    for layer in trace.layers:
        counts = torch.bincount(trace.expert_ids[layer].flatten(), minlength=trace.num_experts).double()
        p = counts / counts.sum()
        nz = p[p > 0]
        entropy = float(-(nz * nz.log()).sum()) / math.log(trace.num_experts)
        out.append(LayerUsage(layer, entropy, float(p.max()), int(p.argmax())))
    return out
