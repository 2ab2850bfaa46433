"""Grouped prefill: each MoE layer of a prompt as one grouped call over the layer's experts, read in place.

Eager prefill asks the provider for each expert a layer's rows were routed to and runs it on its slice of the rows
(``routed_experts.routed_grouped``): on a GPU one expert at a time, launches and a host sync per layer for the
expert list. :class:`GroupedPrefill` holds every routed expert of a store's portable int4 precision in one slab,
as the store holds them, and serves a prompt's layer with ``quant.triton_moe_grouped.moe_prefill_int4``: the
(token, expert) pairs sorted on the device, two launches (gate/up with the SwiGLU, then down) over tiles of one
expert's rows, each token's experts summed in expert-id order in float32 (``layer_step.add_routed``, the rule
every path keeps). Nothing in it waits on the device; the observers, where a model has any, still get the layer's
routing on the host (``routed_experts.serve_routing``).

For a model whose experts are all resident (an ``InMemoryExpertProvider``); with experts streamed under a budget,
``runtime.staged_prefill`` stages each layer's experts in a few slots of a smaller slab as their reads land. The
slab is a second copy of the experts beside the provider's own (the provider's serve decode); docs/gpu.md. Checked
on the CPU under Triton's interpreter against the eager prefill (tests/test_grouped_prefill.py); not measured on a
GPU. The slab is read from a store by ``runtime.grouped_prefill``.

Without Triton for the slab's device (a CPU without ``TRITON_INTERPRET``) the same layer runs in torch: the pairs
sorted by expert (``dispatch.group_by_expert``), each expert dequantized from its slot and run on its rows (the
``dequant`` kernel of ``quant.linear``), the k passes of ``add_routed``: the eager prefill's structure, so its
logits are the eager prefill's bit for bit on a model whose experts are the same dequantized ones.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from fate_edge.model.dispatch import group_by_expert
from fate_edge.model.experts import QuantizedExpert
from fate_edge.model.layer_step import add_routed
from fate_edge.model.routed_experts import add_by_rank
from fate_edge.quant.linear import QuantizedLinear
from fate_edge.quant.triton_moe import Int4MoELayout, triton_available
from fate_edge.quant.triton_moe_grouped import moe_prefill_int4


class GroupedPrefill:
    """The routed experts of every MoE layer in the slots of one slab (portable int4 blobs of ``precision``, a
    ``format.store.Precision``), expert ``e`` of ``layer`` in slot ``slot_of[layer][e]``; a prompt's layer computed
    from them in two Triton launches (or, without Triton for the slab's device, in torch)."""

    def __init__(self, slab: torch.Tensor, slot_of: dict[int, torch.Tensor], precision: Any, block_m: int = 16):
        self.slab, self.slot_of, self.precision, self.block_m = slab, slot_of, precision, block_m
        self.layout = Int4MoELayout.of(precision)  # refuses another layout, naming the fix
        interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        self.triton = triton_available() and (slab.device.type == "cuda" or interpreted)
        self.calls = 0  # layers served

    def __call__(
        self, layer: int, h: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, acc: torch.Tensor | None
    ) -> torch.Tensor:
        """``acc`` (the layer's float32 sum so far: the residual in a float32 model, else None) plus the routed
        experts of rows ``h`` [N, H] (``idx``, ``weights`` [N, k]) in expert-id order → the sum [N, H]."""
        self.calls += 1
        if not self.triton:
            return self._torch(layer, h, idx, weights, acc)
        ys, ws = moe_prefill_int4(h, idx, weights, self.slab, self.slot_of[layer], self.layout, block_m=self.block_m)
        for j in range(idx.shape[1]):  # an expert's rows in the activations' dtype, as every path has them
            acc = add_routed(acc, ys[:, j].to(h.dtype) if h.dtype != torch.float32 else ys[:, j], ws[:, j : j + 1])
        assert acc is not None  # k >= 1
        return acc

    def _torch(
        self, layer: int, h: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, acc: torch.Tensor | None
    ) -> torch.Tensor:
        """The layer in torch, as ``routed_experts.routed_grouped`` computes it, each expert from its slot."""
        g = group_by_expert(idx)
        rows = h.index_select(0, g.tokens)
        ys = torch.empty_like(rows)
        slots = self.slot_of[layer].tolist()
        for e, a in zip(g.ids, g.starts):
            part = slice(a, a + g.counts[e])
            ys[part] = self.expert(slots[e])(rows[part])
        return add_by_rank(acc, ys, g, idx, weights)

    def expert(self, slot: int) -> QuantizedExpert:
        """The expert in ``slot``, dequantized per call from views of its blob (nothing kept)."""
        p, blob = self.precision, self.slab[slot]
        scale = getattr(torch, p.scale_dtype)
        dtypes = {"codes": torch.uint8, "scale": scale, "zero": scale}
        t = {
            q.name: blob[q.offset : q.offset + q.nbytes].view(dtypes[q.name.split(".")[1]]).view(q.shape)
            for q in p.parts
        }
        gate, up, down = (
            QuantizedLinear.from_packed(
                t[f"{m}.codes"], t[f"{m}.scale"], t.get(f"{m}.zero"), p.spec, blob.device, "dequant"
            )
            for m in ("gate", "up", "down")
        )
        return QuantizedExpert(gate, up, down, glu=p.glu)
