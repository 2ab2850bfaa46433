"""A MoE layer's routed experts from the model's expert provider (the eager paths: prompts, batches, one-token
decode, and the per-layer CUDA graphs between their replays).

After the router: the observers see the routing (the scheduler issues the layer's reads, predictors look ahead),
the shared expert computes while those reads travel, the routed experts arrive from the provider in any order (cache
hits first) and are summed in expert-id order by :func:`~fate_edge.model.layer_step.add_routed` (in float32: into
the residual itself in a float32 model, else into an accumulator added once), the shared expert last. One row calls
its k experts directly; several rows are grouped by expert (``dispatch.group_by_expert``: one gather, each expert on
its contiguous slice) and summed in k passes, pass j adding every row's j-th expert by id, so each row gets the
one-row path's bits. The provider hands experts out in groups (``stream_groups``: the scheduler's cache hits
together, then the reads that have landed); a group of native int4 experts computes in grouped kernel calls
(``grouped_experts``), with each expert's own bits. Where there are no reads to overlap (a decode token's experts
all at hand, ``ExpertProvider.all_at_hand``) and the shared expert is native int4 too, it computes in the same
calls (``grouped_experts.group_rows_with_shared``): the same bits, fewer parallel regions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from fate_edge.model.dispatch import ExpertGroups, group_by_expert
from fate_edge.model.grouped_experts import (
    FusedRow,
    NativeShared,
    fused_row_with_shared,
    group_rows,
    group_rows_with_shared,
    native_shared,
)
from fate_edge.model.layer_step import (
    ExpertInput,
    Moe,
    add_moe,
    add_routed,
    add_shared,
    moe_sum,
    shared_out,
)
from fate_edge.model.row_ops import add_expert_rows, add_experts

if TYPE_CHECKING:
    from fate_edge.model.decoding_model import DecodingModel
    from fate_edge.model.layer import LayerPlan

Shared = Callable[[], "tuple[torch.Tensor, torch.Tensor | None] | None"]


def provider_moe(model: DecodingModel, decode: bool | torch.Tensor) -> Moe:
    """The ``moe`` part of a :class:`~fate_edge.model.layer_step.LayerPath`, experts from ``model.experts``;
    ``decode``: whether its rows are decode tokens (all, none, or a bool mask over the rows)."""

    def moe(
        x: torch.Tensor, h: torch.Tensor, layer: int, lp: LayerPlan, weights: torch.Tensor, idx: torch.Tensor
    ) -> torch.Tensor:
        return moe_block(model, x, h, layer, lp, weights, idx, decode)

    return moe


def moe_block(
    model: DecodingModel,
    x: torch.Tensor,
    h: torch.Tensor,
    layer: int,
    lp: LayerPlan,
    weights: torch.Tensor,
    idx: torch.Tensor,
    decode: bool | torch.Tensor,
    observed: bool = False,
) -> torch.Tensor:
    """:func:`provider_moe`'s MoE block on a layer's routing → ``x`` updated. ``observed``: the observers have seen
    this routing already (``fate_edge.model.decode_layer``'s first phase told them)."""
    mlp, down = lp.mlp, lp.down
    if mlp is None or down is None:
        return serve_routing(model, x, h, layer, weights, idx, _no_shared, decode, observed=observed)
    shared = lambda: shared_out(model.act, h, mlp, down)  # noqa: E731
    one_row = h.shape[0] == 1 and h.device.type == "cpu"  # the native kernel's device
    fold = native_shared(model.act, mlp, down) if one_row and model.experts.all_at_hand else None
    return serve_routing(model, x, h, layer, weights, idx, shared, decode, fold, observed)


def _no_shared() -> None:
    return None


def serve_routing(
    model: DecodingModel,
    x: torch.Tensor,
    h: torch.Tensor,
    layer: int,
    weights: torch.Tensor,
    idx: torch.Tensor,
    shared: Shared,
    decode: bool | torch.Tensor = True,
    fold: NativeShared | None = None,
    observed: bool = False,
) -> torch.Tensor:
    """After a layer's routing (weights, ids [N, k] on ``h``'s device): the observers, then ``shared()`` (computed
    while the reads travel, or already computed by a layer graph), the routed experts into ``x``, the shared expert
    last → ``x``, updated in place. ``decode``: which rows are decode tokens (``layer_step.expert_rows``). ``fold``:
    the shared expert's native matrices, for one row whose experts are all at hand: computed in the routed experts'
    kernel calls where they group (else ``shared()`` as usual). ``observed``: the observers saw this routing already."""
    grouped = getattr(model, "grouped_prefill", None) if h.shape[0] > 1 and decode is False else None
    model.residual = x
    if model.observers or grouped is None:  # a grouped prompt layer without observers: no host sync
        host_w, host_idx = (weights, idx) if h.device.type == "cpu" else routing_to_host(weights, idx)
        for obs in () if observed else model.observers:
            obs(layer, h, host_idx, host_w)
    acc = moe_sum(x)
    if grouped is not None:  # a prompt's rows, every expert in one grouped call (grouped_prefill)
        z = shared()
        acc = grouped(layer, h, idx, weights, acc)
        model.experts.end_layer(layer)
    elif h.shape[0] == 1:
        parts, weight_of, z = routed_parts(model, h, layer, host_w, host_idx, bool(decode), shared, fold)
        if isinstance(parts, FusedRow):  # every expert and the shared one in one kernel call
            if acc is None and add_fused_row(x, parts, weight_of):
                return x
            parts, z = parts.tensors()
        order = sorted(parts)  # expert-id order, as add_parts adds them
        # the sum starts at moe_sum(x): one native call may add it all, with add_parts's and add_shared's bits
        if (acc is None or acc is x) and add_experts(x, [parts[e] for e in order], [weight_of[e] for e in order], z):
            return x
        acc = add_parts(acc, parts, weight_of)
    else:
        z = shared()
        acc = routed_grouped(model, acc, h, layer, weights, idx, decode)
    return add_moe(x, acc if z is None else add_shared(acc, *z))


def routing_to_host(weights: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A GPU layer's routing on the host in one copy (the layer's one sync): the observers and the expert loop
    then read Python numbers, where each ``tolist``/``unique`` of a GPU tensor would wait on the GPU again.
    Expert ids travel as float32, exact below 2**24."""
    k = weights.shape[1]
    both = torch.cat([weights.float(), idx.float()], dim=1).cpu()
    return both[:, :k], both[:, k:].long()


def routed_one(
    model: DecodingModel,
    acc: torch.Tensor | None,
    h: torch.Tensor,
    layer: int,
    host_w: torch.Tensor,
    host_idx: torch.Tensor,
    decode: bool = True,
) -> torch.Tensor | None:
    """One row: its k experts called directly (no sort or index bookkeeping), added to the float32 sum ``acc``
    (:func:`~fate_edge.model.layer_step.moe_sum`) in expert-id order with their weights as Python floats
    (``host_w``, ``host_idx`` [1, k] on the host) → the sum [1, H] (None: none started and every expert skipped)."""
    parts, weight_of, _ = routed_parts(model, h, layer, host_w, host_idx, decode)
    assert not isinstance(parts, FusedRow)  # only a folded shared expert fuses
    return add_parts(acc, parts, weight_of)


def add_parts(
    acc: torch.Tensor | None, parts: dict[int, torch.Tensor], weight_of: dict[int, float]
) -> torch.Tensor | None:
    """One row's computed experts (:func:`routed_parts`) added to the float32 sum ``acc`` by
    :func:`~fate_edge.model.layer_step.add_routed` in expert-id order, whatever order they arrived in → the sum."""
    for e in sorted(parts):
        acc = add_routed(acc, parts[e], weight_of[e])
    return acc


def add_fused_row(x: torch.Tensor, row: FusedRow, weight_of: dict[int, float]) -> bool:
    """A :class:`FusedRow`'s experts (in expert-id order, by their weights) and shared expert added into a bf16
    residual ``x`` in one native call, with ``add_experts``'s bits (``row_ops.add_expert_rows``) → False where the
    kernel does not take ``x`` (nothing done)."""
    outputs = row.outputs()
    order = sorted(outputs)
    c = row.call
    gate = None if c.gate is None else row.address(c.gate)
    return add_expert_rows(x, [outputs[e] for e in order], [weight_of[e] for e in order], row.address(c.shared), gate)


def routed_parts(
    model: DecodingModel,
    h: torch.Tensor,
    layer: int,
    host_w: torch.Tensor,
    host_idx: torch.Tensor,
    decode: bool = True,
    shared: Shared = _no_shared,
    fold: NativeShared | None = None,
) -> tuple[dict[int, torch.Tensor] | FusedRow, dict[int, float], tuple[torch.Tensor, torch.Tensor | None] | None]:
    """One row's k experts and shared expert, not yet added → (each computed expert's output rows, each routed
    expert's weight as a Python float, ``shared()``'s output): the shared expert computed before the experts arrive,
    or, where ``fold`` is given and the first group's experts group with it, in their kernel calls. Where that group
    is every expert and they fuse (``grouped_experts.fused_row_with_shared``), the outputs come as one
    :class:`FusedRow` (the shared expert's inside it, the third item None)."""
    weight_of = dict(zip(host_idx.tolist()[0], host_w.tolist()[0]))  # exact: float32 → Python float → float32
    rows = ExpertInput(h, decode)
    parts: dict[int, torch.Tensor] = {}
    z = None if fold is not None else shared()
    fused = None
    for group in model.experts.stream_groups(layer, sorted(weight_of)):
        if fold is not None and len(group) == len(weight_of):
            fused = fused_row_with_shared(group, h, fold)
            if fused is not None:  # every expert was in this group: no other comes
                fold = None
                continue
        both = group_rows_with_shared(group, h, fold) if fold is not None else None
        if both is not None:
            got, z = both
        else:
            if fold is not None:  # the experts do not group with it: the shared expert on its own
                z = shared()
            got = group_rows(group, rows)
        fold = None
        parts.update(got)  # an expert skipped by precision-on-miss (opt-in) has no part
    if fold is not None:  # no group at all
        z = shared()
    model.experts.end_layer(layer)
    return (parts if fused is None else fused), weight_of, z


def routed_grouped(
    model: DecodingModel,
    acc: torch.Tensor | None,
    h: torch.Tensor,
    layer: int,
    weights: torch.Tensor,
    idx: torch.Tensor,
    decode: bool | torch.Tensor = False,
) -> torch.Tensor:
    """Several rows: one stable sort of the (row, expert) pairs by expert, one gather of the inputs, each expert on
    its contiguous slice (no per-expert mask, nonzero or scatter), then k passes of :func:`add_routed` into the
    float32 sums ``acc`` [N, H] (None: from zero) → the sums."""
    g = group_by_expert(idx)
    grouped_decode = decode.index_select(0, g.tokens) if isinstance(decode, torch.Tensor) else decode
    rows = ExpertInput(h.index_select(0, g.tokens), grouped_decode)  # [N*k, H], rows grouped by expert id
    ys = torch.empty_like(rows.h)  # bf16 kernel outputs widen exactly into a float32 model's rows
    parts = {e: slice(a, a + g.counts[e]) for e, a in zip(g.ids, g.starts)}
    for group in model.experts.stream_groups(layer, g.by_popularity()):  # cache hits together, then reads
        for e, expert in group:
            if expert is None:  # skipped by precision-on-miss (opt-in): its rows add zero
                ys[parts[e]] = 0
        for e, y in group_rows(group, rows, parts).items():
            ys[parts[e]] = y
    model.experts.end_layer(layer)
    return add_by_rank(acc, ys, g, idx, weights)


def add_by_rank(
    acc: torch.Tensor | None, ys: torch.Tensor, g: ExpertGroups, idx: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """The grouped experts' output rows ``ys`` (in ``g``'s expert order) added to the float32 sums ``acc`` in
    k passes: pass j adds every row's j-th expert by id, so each row's experts are summed in expert-id order."""
    by_rank = g.by_rank(idx)  # [k blocks of N rows]: block j holds every row's j-th expert by id, rows in order
    ys = ys.index_select(0, by_rank)
    w = weights.flatten().index_select(0, g.order).index_select(0, by_rank)[:, None]
    n = idx.shape[0]
    for j in range(idx.shape[1]):
        acc = add_routed(acc, ys[j * n : (j + 1) * n], w[j * n : (j + 1) * n])
    assert acc is not None  # k >= 1
    return acc
