"""Grouped prefill from a store: every routed expert of its portable int4 precision read (CRC-checked) into one
slab on the model's device, served by ``model.grouped_prefill.GroupedPrefill``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from fate_edge.format.blob import file_identity, mark_verified
from fate_edge.format.store import ExpertStore
from fate_edge.model.experts import InMemoryExpertProvider
from fate_edge.model.grouped_prefill import GroupedPrefill
from fate_edge.quant.triton_moe import Int4MoELayout

if TYPE_CHECKING:
    from fate_edge.model.decoding_model import DecodingModel


def load_grouped_prefill(store: ExpertStore | str | Path, device: str | torch.device = "cpu", bits: int = 4):
    """Every routed expert of ``store``'s portable ``bits`` precision in one slab on ``device`` → the server."""
    store = store if isinstance(store, ExpertStore) else ExpertStore(store)
    if bits not in store.precisions:
        raise ValueError(f"{store.path} has no int{bits} experts (it has {store.bits_available})")
    layout = Int4MoELayout.of(store.precisions[bits])  # refuses another layout (before reading), naming the fix
    layers, n = list(store.index["moe_layers"]), int(store.index["num_experts"])
    slab = torch.zeros(len(layers) * n, layout.slot_bytes, dtype=torch.uint8)
    refs = [(store.ref(layer, e, bits), i * n + e) for i, layer in enumerate(layers) for e in range(n)]
    refs.sort(key=lambda r: (r[0].path, r[0].offset))
    f, opened, identity = None, None, None
    try:
        for ref, slot in refs:  # in file order
            if ref.path != opened:
                if f is not None:
                    f.close()
                f, opened = open(ref.path, "rb"), ref.path
                identity = file_identity(f.fileno())
            assert f is not None and identity is not None
            f.seek(ref.offset)
            payload = f.read(ref.length)
            mark_verified(ref, payload, identity)  # a corrupt blob is refused, named
            slab[slot, : ref.length] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    finally:
        if f is not None:
            f.close()
    slot_of = {layer: torch.arange(i * n, (i + 1) * n, device=device) for i, layer in enumerate(layers)}
    return GroupedPrefill(slab.to(device), slot_of, store.precisions[bits])


def use_grouped_prefill(model: DecodingModel, store: ExpertStore | str | Path) -> GroupedPrefill:
    """Serve ``model``'s prompts (rows that are not decode tokens) with grouped calls from ``store``'s portable int4
    experts; the model's experts must be resident (the slab holds the same experts) → the grouped server."""
    if not isinstance(model.experts, InMemoryExpertProvider):
        raise ValueError(
            "grouped prefill is for resident experts: load the model with every expert in memory "
            f"(its provider is a {type(model.experts).__name__})"
        )
    grouped = load_grouped_prefill(store, model.device)
    model.grouped_prefill = grouped
    return grouped
