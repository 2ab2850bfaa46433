"""What the decode steps read of a model, as a structural type: ``MoETransformer`` is one. The steps
(``decode_step``, ``compiled_step``, ``graph_step``, ``runner``) are called by the transformer, so they name this
protocol rather than import the transformer back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from fate_edge.model.arch.base import ModelConfig
from fate_edge.model.embedding import QuantizedEmbedding
from fate_edge.model.experts import ExpertProvider
from fate_edge.model.kv_cache import KVCache
from fate_edge.model.layer import Fused, LayerPlan, Weights
from fate_edge.model.rope import RotaryEmbedding

# Called after each MoE layer's routing: (layer, gate input [N, H], expert ids [N, k], weights [N, k]). An observer
# sees every prompt token in every layer unless all of them say ``needs_every_token = False``: then a prompt asked
# for its last logits only runs the last layer's MLP or MoE on its last token (MoETransformer.forward).
RoutingObserver = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]


class StepRunner(Protocol):
    """How a model's one-token decode steps run (``runner.DecodeRunner`` and its kinds)."""

    def step(
        self, model: DecodingModel, token: torch.Tensor, cache: KVCache, plan: list[LayerPlan]
    ) -> torch.Tensor: ...


class DecodingModel(Protocol):
    config: ModelConfig
    experts: ExpertProvider
    dtype: torch.dtype
    act: Callable[[torch.Tensor], torch.Tensor]
    rope: RotaryEmbedding
    observers: list[RoutingObserver]
    residual: torch.Tensor | None  # the routed layer's residual stream while observers run
    w: Weights
    embed: torch.Tensor | QuantizedEmbedding
    fast_decode: bool
    _plan_version: int  # which ``w.version`` the plan was built from (a compiled step checks it)
    runner: StepRunner | None  # how its decode steps run (fate_edge.model.runner), None: not chosen yet
    graph_off: str | None  # why a CUDA model decodes without CUDA graphs
    # serves a prompt's MoE layers in grouped calls (grouped_prefill.GroupedPrefill), None: the provider's experts
    grouped_prefill: Callable[..., torch.Tensor] | None

    @property
    def cuda_graphs(self) -> bool: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def head(self) -> Fused: ...

    def plan(self) -> list[LayerPlan]: ...

    def new_cache(self) -> KVCache: ...

    def rope_permutation(self, dtype: torch.dtype) -> torch.Tensor: ...

    def route(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def __call__(self, input_ids: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor: ...
