"""A whole decode step as one torch.compile'd graph (inductor: C++ kernels on the CPU), experts resident.

The eager fast path (:mod:`fate_edge.model.decode_step`) dispatches ~230 operators per token from Python and at the
bundled model's size each costs more than its arithmetic. When every routed expert is resident in memory
(``InMemoryExpertProvider``: int4 on torch's kernel, or float), the step has no I/O to wait for, so embedding,
every layer (the one layer function, :func:`fate_edge.model.layer_step.decoder_layer`, with an attention over a
static buffer and the token's k experts picked by ``index_select`` from per-layer stacks), the final norm and the
head are one graph: one call per token. Routed experts are added in expert-id order by the rule every path uses.

Shapes stay static across positions: k and v are written into the cache's preallocated buffers at a position
tensor (``kv_cache.StaticKV``: the one attention, ``attention.gqa``, masks the buffers' unused tail), and their
length is marked dynamic, so a grown cache does not recompile. Inductor caches compiled kernels on disk
(``TORCHINDUCTOR_CACHE_DIR``): a later process re-traces (seconds) but does not recompile C++. A per-layer graph
with the experts left in Python was tried first and was no faster than eager (its guard checks and wrapper cost what
its ~10 operators saved: docs/measured-choices.md).

It is a decode runner (:mod:`fate_edge.model.runner`), chosen once by ``set_compile`` where :func:`unsupported`
allows (not for streamed experts, quantized resident weights, sliding windows); a failure to compile hands the
model over to the eager runner for good.
"""

from __future__ import annotations

import shutil
import sys
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from fate_edge.model.attention import gqa
from fate_edge.model.embedding import lookup
from fate_edge.model.experts import ExpertWeights, InMemoryExpertProvider, QuantizedExpert
from fate_edge.model.kv_cache import LayerCache, StaticKV
from fate_edge.model.layer import Fused, LayerPlan, apply_linear, rms_norm
from fate_edge.model.layer_step import (
    Attention,
    LayerPath,
    Moe,
    add_moe,
    add_projection,
    add_routed,
    add_shared,
    decoder_layer,
    moe_sum,
    shared_out,
)
from fate_edge.model.runner import DecodeRunner

if TYPE_CHECKING:
    from collections.abc import Callable

    from fate_edge.model.arch.base import ModelConfig
    from fate_edge.model.decoding_model import DecodingModel
    from fate_edge.model.embedding import QuantizedEmbedding
    from fate_edge.model.kv_cache import KVCache

MODES = ("auto", "on", "off")


@dataclass
class GraphConsts:
    """The model's parts the graph reads that are not per layer."""

    config: ModelConfig
    act: Callable[[torch.Tensor], torch.Tensor]
    embed: torch.Tensor | QuantizedEmbedding
    norm: torch.Tensor


@dataclass(frozen=True)
class StepShape:
    """What the graph reads besides tensors (constants to it)."""

    eps: float
    int4_group: int | None  # experts on torch's int4 kernel (group size), or None: float experts


def _experts_of(model: DecodingModel) -> dict[int, list]:
    prov, cfg = model.experts, model.config
    assert isinstance(prov, InMemoryExpertProvider)  # callers check unsupported_experts first
    return {i: [prov.experts.get((i, e)) for e in range(cfg.num_experts)] for i in cfg.moe_layers}


def unsupported(model: DecodingModel) -> str | None:
    """Why ``model``'s decode steps cannot be compiled, or None when they can."""
    cfg = model.config
    if model.config.recurrent:
        return "recurrent token mixers (short convolutions, linear attention)"
    if not model.fast_decode:
        return "this architecture (MLA, q/k norms or clipped q/k/v)"
    if model.dtype != torch.float32:
        return "bf16 models (compiled decode is tested on float32 models, int4 or float experts)"
    if cfg.sliding_window is not None and cfg.sliding_window_layers:
        return "sliding-window attention"
    if cfg.expert_bias or cfg.swiglu_limit is not None:
        return "gpt-oss experts (biases and the clamped SwiGLU)"
    if model.embed.device.type != "cpu":
        return f"device {model.embed.device.type} (compiled decode is for the CPU)"
    for lp in model.plan():
        for f in (lp.qkv, lp.o_proj, lp.mlp, lp.down):
            if f is not None and not isinstance(f.weight, torch.Tensor):
                return "quantized resident weights (--resident-bits)"
    why = unsupported_experts(model)
    if why is not None:
        return why
    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        return "a host without a C++ compiler (g++, c++ or clang++ on PATH)"
    return None


def unsupported_experts(model: DecodingModel) -> str | None:
    """Why ``model``'s routed experts cannot be stacked for one-graph decode (compiled or captured), or None."""
    if not isinstance(model.experts, InMemoryExpertProvider):
        return "experts streamed from a store (every expert must be resident in memory)"
    kinds = {_kind(e) for layer in _experts_of(model).values() for e in layer}
    if len(kinds) != 1 or None in kinds:
        return "this mix of expert formats (all int4 on torch's kernel, or all float)"
    return None


def _kind(e) -> str | None:
    if isinstance(e, QuantizedExpert) and e.gate_up is not None and e.takes_bf16:
        return f"int4-{e.gate_up.spec.group_size}"
    if isinstance(e, ExpertWeights):
        return "float"
    return None


def stack_experts(model: DecodingModel) -> list[tuple[torch.Tensor, ...] | None]:
    """Per layer, its experts' matrices stacked along a new first axis (None for dense layers); each expert's
    own tensors become views into the stacks, so resident expert memory does not grow."""
    out: list[tuple[torch.Tensor, ...] | None] = [None] * model.config.num_hidden_layers
    for i, experts in _experts_of(model).items():
        if isinstance(experts[0], QuantizedExpert):
            stacks = []
            for role, attr in (
                ("gate_up", "packed"),
                ("gate_up", "scale_zero"),
                ("down", "packed"),
                ("down", "scale_zero"),
            ):
                lins = [getattr(e, role) for e in experts]
                st = torch.stack([getattr(lin, attr) for lin in lins])
                for k, lin in enumerate(lins):
                    setattr(lin, attr, st[k])
                stacks.append(st)
            out[i] = tuple(stacks)
        else:
            gu = torch.stack([torch.cat([e.gate, e.up]) for e in experts])
            down = torch.stack([e.down for e in experts])
            for k, e in enumerate(experts):
                e.gate_up, e.down = gu[k], down[k]
                e.gate, e.up = gu[k].chunk(2, dim=0)
            out[i] = (gu, down)
    return out


def _expert(s: StepShape, act, h: torch.Tensor, hb: torch.Tensor, stacks: tuple, e: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` [1] of a layer's ``stacks`` on the gate input ``h`` (``hb``: it in bf16) → [1, H], as the eager
    paths compute it (``layer_step.expert_rows``): int4 experts in bf16 from ``hb``, float ones in ``h``'s dtype."""
    if s.int4_group is not None:
        pgu, sgu, pd, sd = (t.index_select(0, e)[0] for t in stacks)
        mm = torch._weight_int4pack_mm_for_cpu if hb.device.type == "cpu" else torch._weight_int4pack_mm
        gate, up = mm(hb, pgu, s.int4_group, sgu).chunk(2, dim=-1)
        return mm(F.silu(gate) * up, pd, s.int4_group, sd)
    gu, down = (t.index_select(0, e)[0] for t in stacks)
    gate, up = F.linear(h, gu).chunk(2, dim=-1)
    return F.linear(act(gate) * up, down)


def static_attention(cfg: ModelConfig, state: StaticKV, cos: torch.Tensor, sin: torch.Tensor) -> Attention:
    """The ``attention`` part of a :class:`LayerPath` for one token over whole-capacity buffers (``state``: the
    token's position and the buffers; the one attention, ``attention.gqa``, picks its masked kernel for them)."""

    def attention(x: torch.Tensor, h: torch.Tensor, layer: int, lp: LayerPlan) -> torch.Tensor:
        return add_projection(x, gqa(cfg, h, 1, 1, layer, lp, state, cos, sin), lp.o_proj)

    return attention


def stacked_moe(cfg: ModelConfig, s: StepShape, act, stacks: list, routing: list) -> Moe:
    """The ``moe`` part of a :class:`LayerPath` whose experts are resident in per-layer stacks: the token's k
    experts picked inside the graph (no host sync), each layer's routing appended to ``routing`` as (h, ids,
    weights) for the observers after the step."""

    def moe(
        x: torch.Tensor, h: torch.Tensor, layer: int, lp: LayerPlan, weights: torch.Tensor, idx: torch.Tensor
    ) -> torch.Tensor:
        routing.append((h, idx, weights))
        z = shared_out(act, h, lp.mlp, lp.down) if lp.mlp is not None and lp.down is not None else None
        ids, order = idx[0].sort()  # expert-id order, as every path adds them
        ws = weights[0].index_select(0, order)
        hb = h.to(torch.bfloat16) if s.int4_group is not None else h  # the bf16 copy only int4 stacks read
        acc = moe_sum(x)
        for j in range(cfg.num_experts_per_tok):
            acc = add_routed(acc, _expert(s, act, h, hb, stacks[layer], ids[j : j + 1]), ws[j : j + 1])
        return add_moe(x, acc if z is None else add_shared(acc, *z))

    return moe


def step_graph(
    g: GraphConsts,
    s: StepShape,
    token: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    kv: list[tuple[torch.Tensor, torch.Tensor]],
    plan: list[LayerPlan],
    stacks: list,
    head: Fused,
) -> tuple[torch.Tensor, list]:
    """One token through every layer: the graph compiled. → (logits [1, V], per MoE layer (h, ids, weights))."""
    cfg = g.config
    routing: list = []
    attention = static_attention(cfg, StaticKV(kv, pos), cos, sin)
    path = LayerPath(cfg, g.act, attention, stacked_moe(cfg, s, g.act, stacks, routing))
    x = lookup(g.embed, token.view(1))
    for i, lp in enumerate(plan):
        x = decoder_layer(path, x, i, lp)
    x = rms_norm(x, g.norm, s.eps)
    return apply_linear(x, head), routing


def step_shape(model: DecodingModel) -> StepShape:
    """What a one-graph step reads besides tensors: the norm's epsilon, and the group of resident int4 experts
    (None for float experts, or for experts the model streams)."""
    experts = getattr(model.experts, "experts", None)
    spec = getattr(next(iter(experts.values())).gate_up, "spec", None) if experts else None
    return StepShape(model.config.rms_norm_eps, spec.group_size if spec is not None else None)


def report_routing(model: DecodingModel, routing: list) -> None:
    """Hand a finished step's routing (per MoE layer (h, ids, weights)) to the model's observers."""
    if model.observers:
        model.residual = None  # reported after the step: no residual to run anything early on
        for layer, (h, idx, weights) in zip(model.config.moe_layers, routing):
            for obs in model.observers:
                obs(layer, h, idx, weights)


class CompiledDecode(DecodeRunner):
    """A model's decode steps as one compiled graph (the runner ``set_compile`` chooses)."""

    kind = "compiled"

    def __init__(self, model: DecodingModel, mode: str = "on"):
        super().__init__()
        self.mode = mode
        self.shape = step_shape(model)
        self.stacks = stack_experts(model)
        model.plan()  # built now: a plan rebuilt later (weights changed) is what the version check catches
        self.plan_version = model._plan_version
        # Guards would check every weight tensor every token. Skipping them is safe here: this
        # compile serves one model (isolate_recompiles: its own cache), whose weights keep their shapes; the
        # plan version check in step() catches rebuilt weights, and the cache length is a marked dynamic size.
        # cpp_wrapper: the ~170 kernel calls per token are made from C++, not Python (a faster token for a slower
        # cold compile, cached on disk after: docs/measured-choices.md).
        # torch.compile accepts isolate_recompiles, but its typed overloads do not list it.
        self.fn = torch.compile(
            step_graph,
            fullgraph=True,
            isolate_recompiles=True,  # type: ignore[call-overload]
            options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe, "cpp_wrapper": True},
        )

    def step(self, model: DecodingModel, token: torch.Tensor, cache: KVCache, plan: list[LayerPlan]) -> torch.Tensor:
        """``token`` [1, 1] continuing ``cache`` → logits [1, 1, V]."""
        start = cache.length
        if start == 0:  # before a prefill the cache has no buffers to write into: this token eagerly
            return super().step(model, token, cache, plan)
        if model._plan_version != self.plan_version:
            why = "the model's weights changed after compiling (call set_compile again)"
            return self.give_up(model, why).step(model, token, cache, plan)
        cos, sin = model.rope.cos_sin_range(
            start, 1, torch.float32 if model.config.rope.float32 else model.dtype, model.device
        )
        kv = []
        for lay in cache.layers:
            assert isinstance(lay, LayerCache)  # recurrent layers are declined (unsupported)
            bufs = lay.reserve(start + 1)
            for b in bufs:
                torch._dynamo.mark_dynamic(b, 2)  # not maybe_: a specialised length must fail, not pass
            kv.append((bufs[0], bufs[1]))
        try:
            g = GraphConsts(model.config, model.act, model.embed, model.w["model.norm.weight"])
            pos = torch.tensor([start], device=model.device)
            logits, routing = self.fn(g, self.shape, token, cos, sin, pos, kv, plan, self.stacks, model.head)
        except Exception as e:  # noqa: BLE001 (compiler missing or broken, unsupported op: eager still works)
            why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            if self.mode == "on":
                warnings.warn(f"compiled decode failed, decoding eagerly instead ({why})", stacklevel=2)
            print(f"[fate-edge] compiled decode off: {why}", file=sys.stderr)
            return self.give_up(model, why).step(model, token, cache, plan)
        for lay in cache.layers:
            lay.length += 1
        report_routing(model, routing)
        return logits.view(1, 1, -1)

    def warm(self, model: DecodingModel) -> None:
        """Compile now, on a throwaway two-token prefill and two decode steps, not at a request's first token."""
        cache, observers = model.new_cache(), model.observers[:]
        model.observers.clear()  # no routing of these dummy tokens reaches a trace or a predictor
        try:
            with torch.inference_mode():
                model(torch.zeros(1, 2, dtype=torch.long, device=model.device), cache)
                for _ in range(2):
                    model(torch.zeros(1, 1, dtype=torch.long, device=model.device), cache)
        finally:
            model.observers.extend(observers)
