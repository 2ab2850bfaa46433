"""Which decode runner a model gets at its first decode step (``MoETransformer`` asks once; ``set_compile`` picks the
compiled one instead)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from fate_edge.model import slot_step
from fate_edge.model.graph_step import CudaGraphDecode, LayerGraphDecode, unsupported
from fate_edge.model.runner import DecodeRunner

if TYPE_CHECKING:
    from fate_edge.model.decoding_model import DecodingModel


def choose_runner(model: DecodingModel) -> DecodeRunner:
    """The decode runner for ``model`` as it stands: CUDA graphs on a CUDA model that allows them (the whole step
    where every expert is resident; for streamed experts one graph per layer around the reads, or with
    ``FATE_EDGE_SLOT_GRAPHS=1`` the whole step over the cache's slots where the provider has a cache;
    ``model.graph_off`` says why not), else the eager step. The slot step is opt-in until a GPU measures it
    against the per-layer graphs (it replays the whole step again for each layer a token first misses at)."""
    if model.device.type != "cuda" or not model.cuda_graphs:
        return DecodeRunner()
    if unsupported(model) is None:
        return CudaGraphDecode(model)
    model.graph_off = unsupported(model, streamed=True)
    if model.graph_off is not None:
        return DecodeRunner()
    if os.environ.get("FATE_EDGE_SLOT_GRAPHS") == "1" and slot_step.unsupported(model) is None:
        return slot_step.SlotGraphDecode(model)
    return LayerGraphDecode(model)
