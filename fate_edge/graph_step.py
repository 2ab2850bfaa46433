"""A whole decode step replayed as one CUDA graph when every routed expert is resident on the GPU.

Eager decode launches a few hundred kernels a token from Python, each waiting on the interpreter (~5-20 µs of
host time against ~2-5 µs of GPU time at these sizes), and syncs on every routing decision. When the experts are
all resident there is nothing to read, so the step is a pure function of (token, position, KV cache): the same
layer function the compiled CPU step runs (:func:`fate_edge.compiled_step.step_graph`: norms, q/k/v, rope, cache
write at a position tensor, attention over the whole buffer with its tail masked, router top-k, the token's k
experts picked by ``index_select`` from per-layer stacks and summed in expert-id order, shared expert, head) is
captured once per KV capacity and replayed: one launch and no host sync a token.

The graph owns its KV buffers (static addresses): at a request's first decode step the prefill's keys and values
are copied into them and the request's cache points at them from then on, so eager code that reads the cache
(early attention, a fallback step) sees the same tensors. Capacity grows in powers of two (a new capture each
time), so a short request does not hold a whole context's cache. One sequence at a time uses the buffers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .compiled_step import GraphConsts, StepShape, stack_experts, step_graph, unsupported_experts

if TYPE_CHECKING:
    from .fused import LayerPlan
    from .kv_cache import KVCache
    from .model import MoETransformer

MIN_CAPACITY = 256


def unsupported(model: MoETransformer) -> str | None:
    """Why ``model``'s decode steps cannot be captured, or None when they can."""
    if model.device.type != "cuda":
        return f"device {model.device.type} (CUDA graphs need a CUDA model)"
    if not model.fast_decode:
        return "this architecture (MLA, q/k norms or clipped q/k/v)"
    cfg = model.config
    if cfg.sliding_window is not None and cfg.sliding_window_layers:
        return "sliding-window attention"
    return unsupported_experts(model)


class CudaGraphDecode:
    """A model's captured decode step; :meth:`step` returns None where the eager path must run instead.

    ``capture=False`` runs the same static-buffer step without a graph (each step calls the layer function
    eagerly): what the CPU tests exercise, and a way to tell a capture problem from a step problem."""

    def __init__(self, model: MoETransformer, capture: bool = True):
        self.use_graph = capture
        cfg, plan = model.config, model.plan()
        hd = cfg.head_dim
        qkv = plan[0].qkv
        first = next(iter(model.experts.experts.values()))
        spec = getattr(first.gate_up, "spec", None)
        self.shape = StepShape(qkv.sizes[0] // hd, qkv.sizes[1] // hd, hd, cfg.rms_norm_eps,
                               spec.group_size if spec is not None else None)
        self.stacks = stack_experts(model)
        self.plan_version = model._plan_version
        self.failed: str | None = None
        dev = model.device
        rope_dtype = torch.float32 if cfg.rope.float32 else model.dtype
        self.token = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.cos = torch.zeros(1, model.rope.dim, dtype=rope_dtype, device=dev)
        self.sin = torch.zeros_like(self.cos)
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.graph = None  # torch.cuda.CUDAGraph once captured
        self.logits: torch.Tensor | None = None
        self.routing: list = []
        self.captures = 0  # graphs captured (one per capacity reached)

    @property
    def capacity(self) -> int:
        return self.kv[0][0].shape[2] if self.kv else 0

    def _grow(self, model: MoETransformer, cache: KVCache, need: int) -> None:
        """Static KV buffers of at least ``need`` positions, shaped like the cache's; the graph is recaptured."""
        cap = min(model.config.max_position_embeddings, max(MIN_CAPACITY, 1 << (need - 1).bit_length()))
        self.kv = [tuple(b.new_zeros(*b.shape[:2], cap, b.shape[3]) for b in lay.buffers[:2])
                   for lay in cache.layers]
        self.graph = None

    def _attach(self, cache: KVCache) -> None:
        """Point the request's cache at the static buffers, copying what the prefill (or eager steps) wrote."""
        for lay, bufs in zip(cache.layers, self.kv):
            if lay.buffers[0] is not bufs[0]:
                for dst, src in zip(bufs, lay.buffers):
                    dst[:, :, : lay.length] = src[:, :, : lay.length]
                lay.buffers = list(bufs)

    def _run(self, model: MoETransformer, plan: list[LayerPlan]):
        g = GraphConsts(model.config, model.act, model.embed, model.w["model.norm.weight"])
        return step_graph(g, self.shape, self.token, self.cos, self.sin, self.pos, self.kv, plan, self.stacks,
                          model.head)

    def _capture(self, model: MoETransformer, plan: list[LayerPlan]) -> None:
        # Warm-up on a side stream (cuBLAS handles, lazy kernel loads), as torch.cuda.graphs asks; each run writes
        # the same key and value at the same position, so the cache is as one step leaves it.
        side = torch.cuda.Stream(model.device)
        side.wait_stream(torch.cuda.current_stream(model.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._run(model, plan)
        torch.cuda.current_stream(model.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.logits, self.routing = self._run(model, plan)
        self.graph = graph
        self.captures += 1

    def step(self, model: MoETransformer, token: torch.Tensor, cache: KVCache,
             plan: list[LayerPlan]) -> torch.Tensor | None:
        """``token`` [1, 1] continuing ``cache`` → logits [1, 1, V], or None (the cache's length unchanged)."""
        start = cache.length
        if start == 0 or self.failed is not None or start + 1 > model.config.max_position_embeddings:
            return None
        if model._plan_version != self.plan_version:
            self.failed = "the model's weights changed after capture"
            return None
        if start + 1 > self.capacity:
            self._grow(model, cache, start + 1)
        self._attach(cache)
        cos, sin = model.rope.cos_sin_range(start, 1, self.cos.dtype, model.device)
        self.cos.copy_(cos)
        self.sin.copy_(sin)
        self.token.copy_(token.view(1, 1))
        self.pos.fill_(start)
        if not self.use_graph:
            self.logits, self.routing = self._run(model, plan)
        else:
            if self.graph is None:
                try:
                    self._capture(model, plan)
                except Exception as e:  # noqa: BLE001 (an op that cannot be captured: eager still works)
                    self.failed = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                    self.graph = None
                    return None
            self.graph.replay()
        for lay in cache.layers:
            lay.length += 1
        if model.observers:  # reported after the step, as the compiled CPU step does
            model.residual = None
            for layer, (h, idx, weights) in zip(model.config.moe_layers, self.routing):
                for obs in model.observers:
                    obs(layer, h, idx, weights)
        return self.logits.view(1, 1, -1)
