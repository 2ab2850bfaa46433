"""Decode steps replayed as CUDA graphs: the whole step when every expert is resident, else each layer's
attention, router and shared expert, with the routed experts (the reads) between the replays.

Eager decode launches a few hundred kernels a token from Python, each waiting on the interpreter longer than the GPU
runs it at these sizes (docs/measured-choices.md). Both modes run the one layer function
(:func:`fate_edge.model.layer_step.decoder_layer`) with the compiled CPU step's static attention
(:mod:`fate_edge.model.compiled_step`: a cache write at a position tensor, attention over the whole buffer with its
tail masked), captured once per KV capacity and replayed.

* :class:`CudaGraphDecode` (every expert resident): the token's k experts are picked by ``index_select`` from
  per-layer stacks inside the graph, so a token is one replay and no host sync.
* :class:`LayerGraphDecode` (experts streamed through the scheduler): per layer one replay computes the attention,
  the gate input, the routing and the shared expert into static buffers; the routing comes to the host in one copy
  (the layer's one sync), the observers (scheduler, predictors) and the routed experts run as in eager decode
  (``routed_experts.serve_routing``, in place on the static residual), and the next layer's graph reads the result.

The graphs own the KV buffers (static addresses): at a request's first decode step the prefill's keys and values
are copied into them and the request's cache points at them from then on, so eager code that reads the cache
(early attention, a fallback step) sees the same tensors. Capacity grows in powers of two (a new capture each
time), so a short request does not hold a whole context's cache. One sequence at a time uses the buffers.
``capture=False`` runs the same static-buffer code without graphs: what the CPU tests exercise.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch

from fate_edge.model.compiled_step import (
    GraphConsts,
    report_routing,
    stack_experts,
    static_attention,
    step_graph,
    step_shape,
    unsupported_experts,
)
from fate_edge.model.embedding import lookup
from fate_edge.model.kv_cache import StaticKV
from fate_edge.model.layer import apply_linear, rms_norm
from fate_edge.model.layer_step import LayerPath, decoder_layer, shared_out
from fate_edge.model.routed_experts import serve_routing
from fate_edge.model.runner import DecodeRunner

if TYPE_CHECKING:
    from collections.abc import Callable

    from fate_edge.model.decoding_model import DecodingModel
    from fate_edge.model.kv_cache import KVCache
    from fate_edge.model.layer import LayerPlan

MIN_CAPACITY = 256


def unsupported(model: DecodingModel, streamed: bool = False) -> str | None:
    """Why ``model``'s decode steps cannot be captured, or None when they can (``streamed``: per layer, experts
    read between the replays; else the whole step, every expert resident)."""
    if model.config.recurrent:
        return "recurrent token mixers (short convolutions, linear attention)"
    if model.device.type != "cuda":
        return f"device {model.device.type} (CUDA graphs need a CUDA model)"
    if not model.fast_decode:
        return "this architecture (MLA, q/k norms or clipped q/k/v)"
    cfg = model.config
    if cfg.sliding_window is not None and cfg.sliding_window_layers:
        return "sliding-window attention"
    if cfg.expert_bias or cfg.swiglu_limit is not None:
        return "gpt-oss experts (biases and the clamped SwiGLU)"
    return None if streamed else unsupported_experts(model)


class _StaticDecode(DecodeRunner):
    """Static inputs (token, position, rope rows), graph-owned KV buffers, and capture with a shared pool."""

    def __init__(self, model: DecodingModel, capture: bool):
        super().__init__()
        self.use_graph = capture
        cfg = model.config
        self.shape = step_shape(model)
        model.plan()  # built now: a plan rebuilt later (weights changed) is what the version check catches
        self.plan_version = model._plan_version
        dev = model.device
        self.token = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.cos = torch.zeros(1, model.rope.dim, dtype=torch.float32 if cfg.rope.float32 else model.dtype, device=dev)
        self.sin = torch.zeros_like(self.cos)
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.graphs: list = []  # torch.cuda.CUDAGraph per replayed part, once captured
        self.captures = 0  # capture rounds (one per KV capacity reached)

    @property
    def capacity(self) -> int:
        return self.kv[0][0].shape[2] if self.kv else 0

    def give_up(self, model: DecodingModel, why: str) -> DecodeRunner:
        model.graph_off = why
        return super().give_up(model, why)

    def _begin(self, model: DecodingModel, token: torch.Tensor, cache: KVCache) -> bool:
        """Static inputs for this step, buffers grown and attached; False where this token runs eagerly (no prefill
        to copy yet, or past the model's positions)."""
        start = cache.length
        if start == 0 or start + 1 > model.config.max_position_embeddings:
            return False
        if start + 1 > self.capacity:
            cap = min(model.config.max_position_embeddings, max(MIN_CAPACITY, 1 << start.bit_length()))

            def grown(b: torch.Tensor) -> torch.Tensor:
                return b.new_zeros(*b.shape[:2], cap, b.shape[3])

            self.kv = [(grown(lay.buffers[0]), grown(lay.buffers[1])) for lay in cache.layers]
            self.graphs = []
        for lay, bufs in zip(cache.layers, self.kv):  # the request's cache points at the static buffers
            if lay.buffers[0] is not bufs[0]:
                for dst, src in zip(bufs, lay.buffers):
                    dst[:, :, : lay.length] = src[:, :, : lay.length]
                lay.buffers = list(bufs)
        cos, sin = model.rope.cos_sin_range(start, 1, self.cos.dtype, model.device)
        self.cos.copy_(cos)
        self.sin.copy_(sin)
        self.token.copy_(token.view(1, 1))
        self.pos.fill_(start)
        return True

    def _capture(self, model: DecodingModel, parts: list[Callable[[], None]]) -> bool:
        """Capture each of ``parts`` (in replay order, one memory pool) after a warm-up on a side stream (cuBLAS
        handles, lazy kernel loads). Warm-ups write the step's key and value at its position again, which the replay
        then overwrites with its own. False, with :attr:`failed` set, when an operation cannot be captured."""
        dev = model.device
        try:
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(2):
                    for part in parts:
                        part()
            torch.cuda.current_stream(dev).wait_stream(side)
            graphs, pool = [], None
            for part in parts:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    part()
                pool = g.pool()
                graphs.append(g)
        except Exception as e:  # noqa: BLE001 (an op that cannot be captured: eager still works)
            self.failed = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            return False
        self.graphs = graphs
        self.captures += 1
        return True

    @staticmethod
    def _finish(cache: KVCache) -> None:
        for lay in cache.layers:
            lay.length += 1


class CudaGraphDecode(_StaticDecode):
    """The whole decode step as one graph (every expert resident)."""

    kind = "cuda-graph"

    def __init__(self, model: DecodingModel, capture: bool = True):
        super().__init__(model, capture)
        self.stacks = stack_experts(model)
        self.logits: torch.Tensor | None = None
        self.routing: list = []

    def step(self, model: DecodingModel, token: torch.Tensor, cache: KVCache, plan: list[LayerPlan]) -> torch.Tensor:
        """``token`` [1, 1] continuing ``cache`` → logits [1, 1, V]."""
        if model._plan_version != self.plan_version:
            return self.give_up(model, "the model's weights changed after capture").step(model, token, cache, plan)
        if not self._begin(model, token, cache):
            return super().step(model, token, cache, plan)
        g = GraphConsts(model.config, model.act, model.embed, model.w["model.norm.weight"])

        def run() -> None:
            self.logits, self.routing = step_graph(
                g, self.shape, self.token, self.cos, self.sin, self.pos, self.kv, plan, self.stacks, model.head
            )

        if not self.use_graph:
            run()
        elif self.graphs or self._capture(model, [run]):
            self.graphs[0].replay()
        else:
            assert self.failed is not None  # _capture says why
            return self.give_up(model, self.failed).step(model, token, cache, plan)
        self._finish(cache)
        report_routing(model, self.routing)  # after the step, as the compiled CPU step reports it
        assert self.logits is not None  # the step just ran
        return self.logits.view(1, 1, -1)


class LayerGraphDecode(_StaticDecode):
    """Per layer, attention + gate input + routing + shared expert replayed as one graph; routed experts eager
    through the model's provider (the scheduler's reads); the head as a last graph."""

    kind = "cuda-layer-graphs"

    def __init__(self, model: DecodingModel, capture: bool = True):
        super().__init__(model, capture)
        self.x = torch.zeros(1, model.config.hidden_size, dtype=model.dtype, device=model.device)  # the residual
        self.outs: list[dict[str, torch.Tensor]] = []  # per layer: h, weights, idx (and z, Qwen's gate), static
        self.logits: torch.Tensor | None = None

    def _parts(self, model: DecodingModel, plan: list[LayerPlan]) -> list[Callable[[], None]]:
        cfg, s, act = model.config, self.shape, model.act
        self.outs = [{} for _ in plan]

        def routed_later(
            x: torch.Tensor, h: torch.Tensor, layer: int, lp: LayerPlan, weights: torch.Tensor, idx: torch.Tensor
        ) -> torch.Tensor:
            """The layer function's ``moe`` inside a layer graph: the routing and the shared expert (computed
            before the routed experts, added after them) into static outputs; :meth:`step` serves the rest."""
            out = self.outs[layer]
            out["h"], out["weights"], out["idx"] = h, weights, idx
            if lp.mlp is not None and lp.down is not None:
                out["z"], gate = shared_out(act, h, lp.mlp, lp.down)
                if gate is not None:
                    out["gate"] = gate
            return x

        def layer(i: int, lp: LayerPlan) -> Callable[[], None]:
            def run() -> None:  # captured: the mask is made inside the graph, from the position buffer
                if i == 0:
                    self.x.copy_(lookup(model.embed, self.token.view(1)))
                attention = static_attention(cfg, StaticKV(self.kv, self.pos), self.cos, self.sin)
                self.x.copy_(decoder_layer(LayerPath(cfg, act, attention, routed_later), self.x, i, lp))

            return run

        def head() -> None:
            self.logits = apply_linear(rms_norm(self.x, model.w["model.norm.weight"], s.eps), model.head)

        return [layer(i, lp) for i, lp in enumerate(plan)] + [head]

    def step(self, model: DecodingModel, token: torch.Tensor, cache: KVCache, plan: list[LayerPlan]) -> torch.Tensor:
        if model._plan_version != self.plan_version:
            return self.give_up(model, "the model's weights changed after capture").step(model, token, cache, plan)
        if not self._begin(model, token, cache):
            return super().step(model, token, cache, plan)
        parts = self._parts(model, plan) if not self.graphs else []  # captured: the graphs replay them
        if self.use_graph and not self.graphs and not self._capture(model, parts):
            assert self.failed is not None  # _capture says why
            return self.give_up(model, self.failed).step(model, token, cache, plan)
        for i, lp in enumerate(plan):
            if self.use_graph:
                self.graphs[i].replay()
            else:
                parts[i]()
            if lp.router is None:
                continue
            out = self.outs[i]
            serve_routing(model, self.x, out["h"], i, out["weights"], out["idx"], partial(_shared, out))
        if self.use_graph:
            self.graphs[-1].replay()
        else:
            parts[-1]()
        self._finish(cache)
        assert self.logits is not None  # the head just ran
        return self.logits.view(1, 1, -1)


def _shared(out: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A layer's shared expert output and Qwen's gate logit from its static outputs; None without a shared expert."""
    return (out["z"], out.get("gate")) if "z" in out else None
