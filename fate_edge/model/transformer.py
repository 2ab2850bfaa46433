"""The MoE transformer forward pass, shared by every supported architecture.

Weights keep their Hugging Face names in one dict (``resident``); routed experts come from an
:class:`~fate_edge.model.experts.ExpertProvider`. Architecture differences are read from the normalised
config (``fate_edge.model.arch``), so this file reads top to bottom like the reference models it matches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from fate_edge.model import decode_step
from fate_edge.model.arch.base import ModelConfig
from fate_edge.model.decoding_model import RoutingObserver, StepRunner
from fate_edge.model.embedding import embedding_table, lookup
from fate_edge.model.experts import ExpertProvider, InMemoryExpertProvider
from fate_edge.model.kv_cache import KVCache, window_layers
from fate_edge.model.layer import (
    Fused,
    LayerPlan,
    Weights,
    build_head,
    build_plan,
    head_logits,
    rms_norm,
)
from fate_edge.model.layer_step import LayerPath, add_projection, decoder_layer, router_block
from fate_edge.model.recurrent import mix, recurrent_specs
from fate_edge.model.rope import RotaryEmbedding
from fate_edge.model.routed_experts import provider_moe

if TYPE_CHECKING:
    from fate_edge.model.graph_step import CudaGraphDecode, LayerGraphDecode
    from fate_edge.model.slot_step import SlotGraphDecode

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "relu": F.relu,
}


@dataclass
class LayerNames:
    """Prefixes of one decoder layer's modules in the checkpoint."""

    attn: str
    mlp: str  # the MoE block or the dense MLP
    input_norm: str
    post_attn_norm: str
    router: str = ""  # the router's prefix: ``{mlp}.gate`` unless named (gpt-oss: ``{mlp}.router``)

    def __post_init__(self) -> None:
        if not self.router:
            self.router = f"{self.mlp}.gate"


class MoETransformer:
    def __init__(
        self,
        config: ModelConfig,
        resident: dict[str, torch.Tensor],
        experts: ExpertProvider,
        layer_names: list[LayerNames],
        dtype: torch.dtype = torch.float32,
    ):
        self.config = config
        self.model_dir: Path | None = None  # the directory load_model read it from
        self.experts = experts
        self.names = layer_names
        self.dtype = dtype
        self.act = _ACTIVATIONS[config.hidden_act]
        self.rope = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)
        self.observers: list[RoutingObserver] = []
        # While observers run: the routed layer's residual stream after its attention [N, H], and the KV cache of
        # the forward in progress (predictors/early_attention.py runs the next layer's attention on them early).
        # None where a step does not expose them (the compiled decode step reports its routing after the fact).
        self.residual: torch.Tensor | None = None
        self.active_cache: KVCache | None = None
        self.w = resident if isinstance(resident, Weights) else Weights(resident)
        self._plan: list[LayerPlan] = []
        self._plan_version = -1
        # a tensor, or a quantized table (fate_edge.model.embedding), read by row from the store where it is mapped
        self.embed = embedding_table(self.w, dtype, self.w.row_sources)
        self._head: Fused | None = None
        # One-token decode through fate_edge.model.decode_step (fewer, larger operators); False: the general path.
        self.fast_decode = decode_step.supported(self)
        # How a one-token decode step runs (fate_edge.model.runner): eager, compiled (set_compile) or CUDA graphs,
        # chosen once; None: chosen at the next decode step (by then an engine has attached its expert provider).
        self.runner: StepRunner | None = None
        # On CUDA: decode steps replayed as CUDA graphs (graph_step: the whole step with every expert resident, else
        # per layer around the streamed experts); False turns it off. ``graph_off`` says why a CUDA model decodes
        # eagerly.
        self._cuda_graphs = True
        self.graph_off: str | None = None
        self.grouped_prefill: Callable[..., torch.Tensor] | None = None  # grouped_prefill.use_grouped_prefill
        self._rope_perm: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        if "lm_head.weight" not in resident and "lm_head.sizes" not in resident and not config.tie_word_embeddings:
            from fate_edge.errors import MissingTensorError

            raise MissingTensorError("checkpoint has no 'lm_head.weight' and tie_word_embeddings is false")

    # ----------------------------------------------------------------- helpers
    def plan(self) -> list[LayerPlan]:
        """Fused per-layer weights, rebuilt when ``self.w`` has changed since the last build."""
        if self._plan_version != self.w.version:
            self._plan = build_plan(self.config, self.w, self.names)
            self._head = build_head(self.w, self.embed)
            self._plan_version = self.w.version
        return self._plan

    @property
    def head(self) -> Fused:
        """The output projection (after :meth:`plan`)."""
        assert self._head is not None
        return self._head

    @property
    def device(self) -> torch.device:
        """Where the resident weights live: every tensor a forward pass makes is made here."""
        return self.embed.device

    def rope_permutation(self, dtype: torch.dtype) -> torch.Tensor:
        key = (self.device, dtype)
        p = self._rope_perm.get(key)
        if p is None:
            p = self._rope_perm[key] = decode_step.roll_permutation(self.rope.dim, dtype, self.device)
        return p

    def kernels(self) -> dict[str, list[str]]:
        """Matmul kernels in use: resident linears by role, and routed experts (``quant.linear.KERNEL_CHOICES``
        records each quantized shape's kernel and, when timed, ``KERNEL_TIMINGS`` why)."""
        out: dict[str, set[str]] = {}
        for lp in self.plan():
            for role in ("qkv", "o_proj", "mlp", "down"):
                f = getattr(lp, role)
                if f is not None:
                    out.setdefault(role, set()).add(_kernel(f.weight))
            for f in lp.mix_in.values():  # a recurrent mixer's input projections
                out.setdefault("mix_in", set()).add(_kernel(f.weight))
        out["lm_head"] = {_kernel(self.head.weight)}
        if isinstance(self.experts, InMemoryExpertProvider) and self.experts.experts:
            out["experts"] = {getattr(e, "kernel", "dense") for e in self.experts.experts.values()}
        return {role: sorted(k) for role, k in out.items()}

    def set_compile(self, mode: str, warm: bool = True) -> str | None:
        """Decode steps as one torch.compile'd graph (``compiled_step``): "on", "auto" (on where supported,
        silently eager elsewhere) or "off". ``warm`` compiles now (seconds with inductor's disk cache warm, a
        minute or more cold) rather than at the first decode token. Returns why it stays off, or None when on."""
        from fate_edge.model.compiled_step import MODES, CompiledDecode, unsupported

        if mode not in MODES:
            raise ValueError(f"compile must be one of {', '.join(MODES)}, not {mode!r}")
        self.runner = None  # off: eager (or CUDA graphs), chosen at the next decode step
        why = "off" if mode == "off" else unsupported(self)
        if why is None:
            self.runner = compiled = CompiledDecode(self, mode)
            if warm:
                compiled.warm(self)
            why = compiled.failed
        elif mode == "on":
            import warnings

            warnings.warn(f"--compile on: decoding eagerly, compiled decode does not support {why}", stacklevel=2)
        return why

    @property
    def cuda_graphs(self) -> bool:
        return self._cuda_graphs

    @cuda_graphs.setter
    def cuda_graphs(self, on: bool) -> None:
        self._cuda_graphs = on
        self.runner = None  # chosen again at the next decode step

    @property
    def graphed(self) -> CudaGraphDecode | LayerGraphDecode | SlotGraphDecode | None:
        """The CUDA graph runner while the model decodes with one."""
        from fate_edge.model.graph_step import CudaGraphDecode, LayerGraphDecode
        from fate_edge.model.slot_step import SlotGraphDecode

        graphs = CudaGraphDecode | LayerGraphDecode | SlotGraphDecode
        return self.runner if isinstance(self.runner, graphs) else None

    def new_cache(self) -> KVCache:
        cfg = self.config
        return KVCache(cfg.num_hidden_layers, recurrent=recurrent_specs(cfg), windows=window_layers(cfg))

    # --------------------------------------------------------------------- MoE
    def route(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router of ``layer`` on gate inputs ``h`` [N, H] → (weights [N, k], expert ids [N, k])."""
        lp = self.plan()[layer]
        assert lp.router is not None, f"layer {layer} is dense"
        return router_block(self.config, h, lp)

    # ----------------------------------------------------------------- forward
    def forward(self, input_ids: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        """``input_ids`` [B, T] continuing ``cache`` → logits [B, T, V] (or [B, 1, V] with last_only)."""
        self.active_cache, self.residual = cache, None
        if input_ids.device != self.device:  # ids built on the CPU (a tokenizer's list): one small copy per call
            input_ids = input_ids.to(self.device)
        try:
            return self._forward(input_ids, cache, last_only)
        finally:  # a finished request's KV cache is not kept alive through the model
            self.active_cache = self.residual = None

    def _forward(self, input_ids: torch.Tensor, cache: KVCache, last_only: bool) -> torch.Tensor:
        cfg = self.config
        plan = self.plan()
        start = cache.length
        t = input_ids.shape[1]
        b = input_ids.shape[0]
        self.experts.begin_forward(t)
        if t == 1 and b == 1 and self.fast_decode:
            if self.runner is None:
                from fate_edge.model.runner_choice import choose_runner

                self.runner = choose_runner(self)
            return self.runner.step(self, input_ids, cache, plan)
        x = lookup(self.embed, input_ids.reshape(-1))  # [B*T, H]
        cos, sin = self.rope.cos_sin_range(start, t, torch.float32 if cfg.rope.float32 else self.dtype, self.device)
        prune = last_only and t > 1 and not any(getattr(o, "needs_every_token", True) for o in self.observers)
        last = len(plan) - 1

        def attend(x: torch.Tensor, h: torch.Tensor, i: int, lp: LayerPlan) -> torch.Tensor:
            out = mix(cfg, h, b, t, i, lp, cache, cos, sin)  # attention, or a recurrent mixer
            x = add_projection(x, out, lp.o_proj)
            if prune and i == last:
                # The last attention has written every position's keys and values; past it only the last
                # position feeds the logits asked for, so the last MLP or MoE runs on B rows, not B*T (as
                # llama.cpp does). For a model trimmed to a layer or two that is most of a prompt's MLP work.
                x = x.view(b, t, -1)[:, -1].contiguous()
            return x

        path = LayerPath(cfg, self.act, attend, provider_moe(self, decode=t == 1))  # one position: decode tokens
        for i, lp in enumerate(plan):
            x = decoder_layer(path, x, i, lp)
        if prune and plan:
            t = 1
        if last_only:
            x = x.view(b, t, -1)[:, -1]
            t = 1
        x = rms_norm(x, self.w["model.norm.weight"], cfg.rms_norm_eps)
        return head_logits(x, self.head).view(b, t, -1)

    __call__ = forward


def _kernel(weight) -> str:
    return f"dense-{str(weight.dtype).removeprefix('torch.')}" if isinstance(weight, torch.Tensor) else weight.kernel
