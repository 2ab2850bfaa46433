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

from fate_edge.model import decode_step, head_matvec, sdpa
from fate_edge.model.arch.base import ModelConfig
from fate_edge.model.decoding_model import RoutingObserver
from fate_edge.model.embedding import embedding_table, lookup
from fate_edge.model.experts import ExpertProvider, InMemoryExpertProvider
from fate_edge.model.kv_cache import KVCache
from fate_edge.model.layer import Fused, LayerPlan, Weights, apply_linear, build_head, build_plan, rms_norm
from fate_edge.model.layer_step import LayerPath, add_projection, decoder_layer, router_block
from fate_edge.model.rope import RotaryEmbedding, apply_rope, yarn_softmax_scale
from fate_edge.model.routed_experts import provider_moe

if TYPE_CHECKING:
    from fate_edge.model.compiled_step import CompiledDecode
    from fate_edge.model.graph_step import CudaGraphDecode, LayerGraphDecode

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
        self.compiled: CompiledDecode | None = None  # after set_compile("on"/"auto")
        # On CUDA: decode steps replayed as CUDA graphs (graph_step: the whole step with every expert resident, else
        # per layer around the streamed experts), made at the first decode step; False turns it off. ``graph_off``
        # says why a CUDA model decodes eagerly.
        self.cuda_graphs = True
        self.graphed: CudaGraphDecode | LayerGraphDecode | None = None
        self.graph_off: str | None = None
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
        self.compiled = None
        why = "off" if mode == "off" else unsupported(self)
        if why is None:
            self.compiled = CompiledDecode(self, mode)
            if warm:
                self.compiled.warm(self)
            why = self.compiled.failed
        elif mode == "on":
            import warnings

            warnings.warn(f"--compile on: decoding eagerly, compiled decode does not support {why}", stacklevel=2)
        return why

    def _graph_step(self):
        """The captured CUDA decode step where it applies (made once), else None."""
        if self.device.type != "cuda" or not self.cuda_graphs:
            return None
        if self.graphed is None and self.graph_off is None:
            from fate_edge.model.graph_step import CudaGraphDecode, LayerGraphDecode, unsupported

            # The whole step where every expert is resident, else per layer around the streamed experts.
            if unsupported(self) is None:
                self.graphed = CudaGraphDecode(self)
            else:
                self.graph_off = unsupported(self, streamed=True)
                if self.graph_off is None:
                    self.graphed = LayerGraphDecode(self)
        if self.graphed is not None and self.graphed.failed is not None:
            self.graph_off = self.graphed.failed
        return self.graphed

    def new_cache(self) -> KVCache:
        return KVCache(self.config.num_hidden_layers)

    # --------------------------------------------------------------- attention
    def _attend(self, q, k, v, start: int, layer: int, scale: float) -> torch.Tensor:
        """q [B, nh, T, d], k/v [B, nkv, S, d] (S includes the cache) → [B, T, nh * dv]."""
        cfg = self.config
        t, s = q.shape[2], k.shape[2]
        window = cfg.sliding_window if layer in cfg.sliding_window_layers else None
        gqa = q.shape[1] != k.shape[1]
        if window is None and t == 1:
            out = sdpa.attention(q, k, v, scale=scale, enable_gqa=gqa)
        elif window is None and t == s:
            out = sdpa.attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            positions = torch.arange(start, start + t, device=q.device)
            key_pos = torch.arange(s, device=q.device)
            mask = key_pos[None, :] <= positions[:, None]
            if window is not None:
                mask &= key_pos[None, :] > positions[:, None] - window
            out = sdpa.attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        b = q.shape[0]
        if t == 1:  # [B, nh, 1, d]: moving the size-1 axis moves no data
            return out.reshape(b * t, -1)
        return out.transpose(1, 2).reshape(b * t, -1)

    def _gqa_attention(self, x, b: int, t: int, start: int, cache, layer: int, cos, sin, lp: LayerPlan):
        """Normed ``x`` [B*T, H] → the attention's output before its projection [B*T, heads * head_dim]
        (activations stay 2-D between layers, so each linear is one matmul)."""
        q, k, v = self.gqa_qkv(x, b, t, cos, sin, lp)
        k, v = cache.layers[layer].append(k, v, capacity_hint=cache.capacity_hint)
        return self._attend(q, k, v, start, layer, scale=self.config.head_dim**-0.5)

    def gqa_qkv(self, x, b: int, t: int, cos, sin, lp: LayerPlan):
        """Normed ``x`` [B*T, H] → q [B, heads, T, hd], k and v [B, kv heads, T, hd], q and k rotated (also what
        predictors/early_attention.py runs a layer early on)."""
        cfg = self.config
        hd = cfg.head_dim
        assert lp.qkv is not None  # GQA layers have one
        qkv = apply_linear(x, lp.qkv)
        n_q, n_k = lp.qkv.sizes[0] // hd, lp.qkv.sizes[1] // hd
        if cfg.qk_norm == "none" and cfg.clip_qkv is None:  # rotate q and k in one pass
            qk = qkv[..., : (n_q + n_k) * hd].view(b, t, n_q + n_k, hd).transpose(1, 2)
            qk = apply_rope(qk, cos, sin, cfg.rope.interleaved)
            q, k = qk[:, :n_q], qk[:, n_q:]
            v = qkv[..., (n_q + n_k) * hd :]
        else:
            q, k, v = _split(qkv, lp.qkv)
            if cfg.qk_norm == "full":  # OLMoE: one norm over all heads
                assert lp.q_norm is not None and lp.k_norm is not None
                q = rms_norm(q, lp.q_norm, cfg.rms_norm_eps)
                k = rms_norm(k, lp.k_norm, cfg.rms_norm_eps)
            if cfg.clip_qkv is not None:
                q, k, v = (z.clamp(-cfg.clip_qkv, cfg.clip_qkv) for z in (q, k, v))
            q = q.view(b, t, -1, hd)
            k = k.view(b, t, -1, hd)
            if cfg.qk_norm == "head":  # Qwen3: per-head norm
                assert lp.q_norm is not None and lp.k_norm is not None
                q = rms_norm(q, lp.q_norm, cfg.rms_norm_eps)
                k = rms_norm(k, lp.k_norm, cfg.rms_norm_eps)
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, heads, T, hd]
            q, k = apply_rope(q, cos, sin, cfg.rope.interleaved), apply_rope(k, cos, sin, cfg.rope.interleaved)
        v = v.reshape(b, t, -1, hd).transpose(1, 2)
        return q, k, v

    def _mla_attention(self, x, b: int, t: int, start: int, cache, layer: int, cos, sin, lp: LayerPlan):
        q, latent = self.mla_qkv(x, b, t, cos, sin, layer, lp)
        # The cache keeps the compressed latent and the rope key (kv_lora_rank + rope dims per token), not per-head
        # keys and values.
        (latent,) = cache.layers[layer].append(latent, capacity_hint=cache.capacity_hint)
        return self.mla_attend(q, latent, start, layer, lp)  # before o_proj, as _gqa_attention

    def mla_qkv(self, x, b: int, t: int, cos, sin, layer: int, lp: LayerPlan):
        """Normed ``x`` [B*T, H] → q [B, heads, T, nope + rope] (rotated), and what MLA caches per position: the
        normed latent and the rotated rope key side by side, [B, 1, T, kv_lora_rank + rope dims]."""
        cfg, m, p = self.config, self.config.mla, self.names[layer].attn
        assert m is not None
        x = x.view(b, t, -1)
        qk_head = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank is None:
            q = apply_linear(x, lp.mla["q_proj"])
        else:
            q_lat = rms_norm(apply_linear(x, lp.mla["q_a_proj"]), self.w[f"{p}.q_a_layernorm.weight"], 1e-6)
            q = apply_linear(q_lat, lp.mla["q_b_proj"])
        q = q.view(b, t, -1, qk_head).transpose(1, 2)
        q_nope, q_rot = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        kv_lat, k_rot = apply_linear(x, lp.mla["kv_a_proj_with_mqa"]).split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
        kv_lat = rms_norm(kv_lat, self.w[f"{p}.kv_a_layernorm.weight"], 1e-6).view(b, 1, t, m.kv_lora_rank)
        k_rot = k_rot.view(b, 1, t, m.qk_rope_head_dim)
        q_rot = apply_rope(q_rot, cos, sin, cfg.rope.interleaved)
        k_rot = apply_rope(k_rot, cos, sin, cfg.rope.interleaved)
        return torch.cat([q_nope, q_rot], dim=-1), torch.cat([kv_lat, k_rot], dim=-1)

    def mla_attend(self, q, latent, start: int, layer: int, lp: LayerPlan) -> torch.Tensor:
        """q [B, heads, T, nope + rope] over a cache's latents and rope keys [B, 1, S, kv_lora_rank + rope]
        (S includes the cache) → [B*T, heads * v_head_dim].

        A decode position with a dense ``kv_b_proj`` attends in the latent space (DeepSeek-V2's absorbed form):
        q's no-rope part goes through each head's key block of ``kv_b_proj`` once, the scores are taken against the
        cached latents themselves (one key "head" shared by every query head, as MQA), and the weighted latent goes
        through the head's value block once. Expanding the cache instead costs ``kv_b_proj`` on every cached
        position at every token: DeepSeek-V2-Lite's 512 x 4096 per position and layer, 2 GFLOP a layer at 1,000
        positions. Prompts expand, as does a ``kv_b_proj`` quantized at convert by an older fate-edge (no quantized
        kernel multiplies from that side; ``layer.resident_groups`` now keeps it in the model's dtype)."""
        m = self.config.mla
        assert m is not None
        r, nope, dv = m.kv_lora_rank, m.qk_nope_head_dim, m.v_head_dim
        kv_b = lp.mla["kv_b_proj"]
        dense = isinstance(kv_b.weight, torch.Tensor) and kv_b.bias is None
        # CPUs without native bf16 emulate a bf16 GEMM (the 4096 x 512 kv_b_proj over a 1,024-token prompt: 0.47 s
        # a layer here, ~50 ms in fp32); the fp32 products of bf16 values are exact, rounded once on the way back
        widen = dense and q.device.type == "cpu" and q.dtype != torch.float32
        if q.shape[2] == 1 and dense:
            return self._mla_absorbed(q, latent, kv_b.weight, widen)
        b, s = latent.shape[0], latent.shape[2]
        kv_lat, k_rot = latent.split([r, m.qk_rope_head_dim], dim=-1)
        if widen:
            kv = F.linear(kv_lat.float(), kv_b.weight.float()).to(q.dtype)
        else:
            kv = apply_linear(kv_lat, kv_b)
        kv = kv.view(b, s, -1, nope + dv).transpose(1, 2)
        k_nope, v = kv.split([nope, dv], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        return self._attend(q, k, v, start, layer, self.mla_scale())

    def _mla_absorbed(self, q, latent, weight: torch.Tensor, widen: bool) -> torch.Tensor:
        """:meth:`mla_attend` for one decode position per sequence, in the latent space; ``weight``: the dense
        ``kv_b_proj``. On the CPU in bf16/fp16 the per-head products run in fate-edge's kernel (``head_matvec``: each
        weight read once, fp32 arithmetic); elsewhere in torch (widened to fp32 on the CPU: ``widen``)."""
        m = self.config.mla
        assert m is not None
        r, nope, dv = m.kv_lora_rank, m.qk_nope_head_dim, m.v_head_dim
        b, heads = q.shape[0], q.shape[1]
        wk, wv = self.mla_blocks(weight, heads)
        scale = self.mla_scale()
        if b == 1 and head_matvec.takes(wk):
            q_lat = self.mla_latent_queries(q[:, :, 0], wk)[:, :, None]  # [1, heads, 1, r + rope]
            o = sdpa.attention(q_lat, latent, latent[..., :r], scale=scale, enable_gqa=heads > 1)
            return self.mla_latent_values(o[:, :, 0], wv)
        q_nope, q_rot = q.split([nope, m.qk_rope_head_dim], dim=-1)
        if widen:
            q_lat = torch.matmul(q_nope.float(), wk.float()).to(q.dtype)
        else:
            q_lat = torch.matmul(q_nope, wk)
        q_lat = torch.cat([q_lat, q_rot], dim=-1)  # [B, heads, 1, r + rope]
        o = sdpa.attention(q_lat, latent, latent[..., :r], scale=scale, enable_gqa=heads > 1)  # [B, heads, 1, r]
        return torch.matmul(o, wv.transpose(1, 2)).reshape(b, heads * dv)

    def mla_blocks(self, weight: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A dense ``kv_b_proj``'s per-head key rows [heads, nope, r] and value rows [heads, v_head_dim, r] (views)."""
        m = self.config.mla
        assert m is not None
        w = weight.view(heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)  # per head: key rows, value rows
        return w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :]

    def mla_latent_queries(self, q: torch.Tensor, wk: torch.Tensor) -> torch.Tensor:
        """Decode queries [V, heads, nope + rope] into the latent space, [V, heads, r + rope]: each head's no-rope
        part through its key block (``head_matvec``), the rope part as it is. Check ``head_matvec.takes`` first."""
        m = self.config.mla
        assert m is not None
        q_nope, q_rot = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        return torch.cat([head_matvec.x_w(q_nope, wk).to(q.dtype), q_rot], dim=-1)

    def mla_latent_values(self, o: torch.Tensor, wv: torch.Tensor) -> torch.Tensor:
        """Weighted latents [V, heads, r] through each head's value block (``head_matvec``) → [V, heads * v_head_dim]
        in o's dtype."""
        return head_matvec.w_x(o, wv).to(o.dtype).reshape(o.shape[0], -1)

    def mla_scale(self) -> float:
        """MLA's softmax scale: 1 / sqrt(the query-key width), times YaRN's attention factor where it applies."""
        m = self.config.mla
        assert m is not None
        return (m.qk_nope_head_dim + m.qk_rope_head_dim) ** -0.5 * yarn_softmax_scale(self.config.rope)

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
            step = self.compiled if self.compiled is not None else self._graph_step()
            out = step.step(self, input_ids, cache, plan) if step is not None else None
            return out if out is not None else decode_step.decode_token(self, input_ids, cache, plan)
        x = lookup(self.embed, input_ids.reshape(-1))  # [B*T, H]
        cos, sin = self.rope.cos_sin_range(start, t, torch.float32 if cfg.rope.float32 else self.dtype, self.device)
        attention = self._mla_attention if cfg.mla is not None else self._gqa_attention
        prune = last_only and t > 1 and not any(getattr(o, "needs_every_token", True) for o in self.observers)
        last = len(plan) - 1

        def attend(x: torch.Tensor, h: torch.Tensor, i: int, lp: LayerPlan) -> torch.Tensor:
            x = add_projection(x, attention(h, b, t, start, cache, i, cos, sin, lp), lp.o_proj)
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
        return apply_linear(x, self.head).view(b, t, -1)

    __call__ = forward


def _kernel(weight) -> str:
    return f"dense-{str(weight.dtype).removeprefix('torch.')}" if isinstance(weight, torch.Tensor) else weight.kernel


def _split(y: torch.Tensor, f: Fused) -> list[torch.Tensor]:
    return y.split(f.sizes, dim=-1) if len(f.sizes) > 1 else [y]
