"""Layer i+1's attention run one layer early, on layer i's residual: an estimate of layer i+1's gate input.

Layer i's gate input decides most of layer i+1's routing; most of the rest is decided by layer i+1's attention
over the other tokens (``research/predictor_ceiling.py``: everything a token's own residual holds before that
attention adds about one point). In decode that attention is mostly known when layer i routes: the keys and
values of every earlier token are already in layer i+1's KV cache; only the current token's own query, key and
value need its layer i+1 input, which does not exist until layer i's experts have run. So run layer i+1's
attention early, on layer i's post-attention residual r_i (the layer i+1 input minus layer i's expert output):

    q, k, v = qkv_{i+1}(input_norm_{i+1}(r_i))
    s = post_norm_{i+1}(r_i + o_{i+1}(attention(q, [K_{<t}, k], [V_{<t}, v])))

K_{<t}, V_{<t} being the true keys and values of the earlier positions. ``s`` is what layer i+1's router would
read if layer i's experts added nothing; a learned predictor reads [h_i, s] (``research/predictor_ceiling.py``
measures it). The price is one more attention per layer and token, on resident weights, while the reads fly.

Here the estimate is computed for recorded windows (training and scoring); every row attends to the true keys
and values of its window's earlier rows and to its own estimated ones (:func:`own_row_attention`), which is
exactly what a decode step computes (:class:`EarlyInput`, which the engine runs for predictors calibrated with
``fate-edge calibrate --early-attention``). GQA attention only (not MLA). Where dense layers sit between two MoE
layers the estimate skips them.
"""

from __future__ import annotations

import torch
from fate_edge.predictors.base import next_moe_layers

from fate_edge.model.attention import attend, gqa, gqa_qkv
from fate_edge.model.kv_cache import KVCache, LayerCache
from fate_edge.model.layer import rms_norm
from fate_edge.model.layer_step import add_projection


def own_row_attention(
    q: torch.Tensor,
    k_own: torch.Tensor,
    v_own: torch.Tensor,
    k_true: torch.Tensor,
    v_true: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention in which row t reads the true keys/values of rows < t and its own estimated ones.

    q [B, nh, T, d]; k_own, v_own, k_true, v_true [B, nkv, T, d] (nh a multiple of nkv) → [B*T, nh*d]; ``sinks``
    [nh]: gpt-oss's per-head logit in the softmax's denominator (``attention.sink_attention``)."""
    rep = q.shape[1] // k_true.shape[1]
    k_own, v_own, k_true, v_true = (
        z.repeat_interleave(rep, 1) if rep > 1 else z for z in (k_own, v_own, k_true, v_true)
    )
    t = q.shape[2]
    pos = torch.arange(t, device=q.device)
    earlier = pos[None, :] < pos[:, None]
    if window is not None:
        earlier &= pos[None, :] > pos[:, None] - window
    scores = (q @ k_true.transpose(-1, -2)).mul_(scale).masked_fill_(~earlier, float("-inf"))
    scores[..., pos, pos] = (q * k_own).sum(-1) * scale  # the diagonal: own query on own estimated key
    if sinks is None:
        p = scores.float().softmax(-1).to(q.dtype)
    else:
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        p = torch.cat([scores.float(), sink], -1).softmax(-1).narrow(-1, 0, t).to(q.dtype)
    # Σ_{s<t} p_s v_s + p_t v_own_t: the true value at the diagonal swapped for the estimated one.
    out = p @ v_true + p[..., pos, pos].unsqueeze(-1) * (v_own - v_true)
    return out.transpose(1, 2).reshape(q.shape[0] * t, -1)


RECURRENT_REFUSED = (
    "early attention runs GQA attention; models with recurrent layers (LFM2 short convolutions, Qwen3-Next "
    "DeltaNet) are not supported"
)


@torch.no_grad()
def early_attention_kv(
    model, residual: torch.Tensor, k_true: torch.Tensor, v_true: torch.Tensor, target: int
) -> torch.Tensor:
    """``s`` for layer ``target`` (module docstring) from ``residual`` [B*T, H] (the estimate of its input, rows
    window-major) and the layer's true keys and values of the same windows, k_true/v_true [B, kv heads, T, d]
    (its KV cache after a forward over them) → [B*T, H] float32."""
    cfg = model.config
    if cfg.mla is not None:
        raise ValueError("early attention runs GQA attention; MLA models (DeepSeek) are not supported")
    if cfg.recurrent:
        raise ValueError(RECURRENT_REFUSED)
    lp = model.plan()[target]
    b, t = k_true.shape[0], k_true.shape[2]
    cos, sin = model.rope.cos_sin_range(0, t, torch.float32 if cfg.rope.float32 else model.dtype, model.device)
    window = cfg.sliding_window if target in cfg.sliding_window_layers else None
    r = residual.to(model.dtype)
    q, k, v = gqa_qkv(model.config, rms_norm(r, lp.input_norm, cfg.rms_norm_eps), b, t, cos, sin, lp)
    out = own_row_attention(q, k, v, k_true, v_true, cfg.head_dim**-0.5, window, lp.sinks)
    r = add_projection(r, out, lp.o_proj)
    return rms_norm(r, lp.post_norm, cfg.rms_norm_eps).float()


def _window_batches(model, layer: int, rows: int, seq_len: int, batch: int):
    """Per batch of ``batch`` windows of ``seq_len`` rows out of ``rows``: (their rows, their window count, the
    layer's plan, rope cos/sin for positions 0..seq_len-1)."""
    cfg = model.config
    cos, sin = model.rope.cos_sin_range(0, seq_len, torch.float32 if cfg.rope.float32 else model.dtype, model.device)
    lp = model.plan()[layer]
    for s in range(0, rows, batch * seq_len):
        part = slice(s, min(rows, s + batch * seq_len))
        yield part, (part.stop - part.start) // seq_len, lp, cos, sin


@torch.no_grad()
def early_attention(
    model, residual: torch.Tensor, true_input: torch.Tensor, target: int, seq_len: int, batch: int = 8
) -> torch.Tensor:
    """:func:`early_attention_kv` with the true keys and values made from ``true_input`` [N, H], layer
    ``target``'s real input before attention (e.g. transformers' ``output_hidden_states``); rows window-major,
    ``seq_len`` a window → [N, H] float32."""
    eps, out = model.config.rms_norm_eps, []
    for part, b, lp, cos, sin in _window_batches(model, target, residual.shape[0], seq_len, batch):
        x = rms_norm(true_input[part].to(model.dtype), lp.input_norm, eps)
        _, k_true, v_true = gqa_qkv(model.config, x, b, seq_len, cos, sin, lp)
        out.append(early_attention_kv(model, residual[part], k_true, v_true, target))
    return torch.cat(out)


@torch.no_grad()
def post_attention_residual(model, layer_input: torch.Tensor, layer: int, seq_len: int, batch: int = 8) -> torch.Tensor:
    """Layer ``layer``'s residual after its own attention, r = x + attention(input_norm(x)), for its inputs
    ``layer_input`` [N, H] (rows window-major, every window from position 0) → [N, H] float32."""
    eps, out = model.config.rms_norm_eps, []
    for part, b, lp, cos, sin in _window_batches(model, layer, layer_input.shape[0], seq_len, batch):
        x = layer_input[part].to(model.dtype)
        cache = KVCache(model.config.num_hidden_layers)
        a = gqa(model.config, rms_norm(x, lp.input_norm, eps), b, seq_len, layer, lp, cache, cos, sin)
        out.append(add_projection(x, a, lp.o_proj).float())
    return torch.cat(out)


def early_gate_inputs(model, inputs: dict[int, torch.Tensor], seq_len: int) -> dict[int, torch.Tensor]:
    """Per MoE layer i with a next MoE layer j: ``s`` for j from i's residual (module docstring). ``inputs`` holds
    every layer's input before attention [N, H] (transformers' ``output_hidden_states``)."""
    out = {}
    for i, j in _pairs(model):
        if i in inputs and j in inputs:
            residual = post_attention_residual(model, inputs[i], i, seq_len)
            out[i] = early_attention(model, residual, inputs[j], j, seq_len)
    return out


def _pairs(model) -> list[tuple[int, int]]:
    """(MoE layer, next MoE layer) for every MoE layer that has one."""
    moe = model.config.moe_layers
    return [(i, nxt[0]) for i in moe if (nxt := next_moe_layers(moe, i, 1))]


class ResidualRecorder:
    """A routing observer (append to ``model.observers``) keeping each MoE layer's residual rows
    (``model.residual``) for :func:`early_inputs_from_cache`."""

    needs_every_token = True

    def __init__(self, model):
        self.model = model
        self.rows: dict[int, list[torch.Tensor]] = {}

    def __call__(self, layer: int, h: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> None:
        r = self.model.residual
        if r is None:
            raise RuntimeError("this forward does not expose its residual stream (compiled decode): run it eagerly")
        self.rows.setdefault(layer, []).append(r.detach().float().clone())

    def take(self) -> dict[int, torch.Tensor]:
        """The rows recorded since the last call, per MoE layer [N, H]; forgets them."""
        out = {i: torch.cat(v) for i, v in self.rows.items()}
        self.rows.clear()
        return out


def early_inputs_from_cache(model, residuals: dict[int, torch.Tensor], cache: KVCache) -> dict[int, torch.Tensor]:
    """After a forward over a batch of windows from an empty ``cache`` (a :class:`ResidualRecorder` attached):
    per MoE layer i with a next MoE layer j, ``s`` for j [B*T, H] from i's residual and j's cached keys/values."""
    out = {}
    for i, j in _pairs(model):
        if i in residuals:
            lay = cache.layers[j]
            assert isinstance(lay, LayerCache)  # recurrent models are refused
            k_true, v_true = (b[:, :, : lay.held] for b in lay.buffers[:2])  # a sliding window's: its end
            out[i] = early_attention_kv(model, residuals[i], k_true, v_true, j)
    return out


class EarlyInput:
    """In the engine: ``s`` for the next MoE layer of the layer being routed, from ``model.residual`` and the
    next layer's KV cache (``model.active_cache``), which holds the earlier positions only (it has not run for
    these rows yet). A decode row gets exactly what :func:`early_attention_kv` computes for the same position; a
    prompt's rows attend to each other's estimated keys and values (their true ones do not exist yet)."""

    def __init__(self, model):
        if model.config.mla is not None:
            raise ValueError("early attention runs GQA attention; MLA models (DeepSeek) are not supported")
        if model.config.recurrent:
            raise ValueError(RECURRENT_REFUSED)
        self.model = model
        self.next = dict(_pairs(model))

    @torch.no_grad()
    def estimate(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """``s`` [N, H] float32 for the rows of ``h`` (zeros where the step exposes no residual or cache)."""
        model, cfg = self.model, self.model.config
        r, cache, target = model.residual, model.active_cache, self.next.get(layer)
        if r is None or cache is None or target is None or r.shape[0] != h.shape[0]:
            return h.new_zeros(h.shape, dtype=torch.float32)
        lay, lp = cache.layers[target], model.plan()[target]
        start = lay.length
        b = lay.buffers[0].shape[0] if lay.buffers else 1
        t = r.shape[0] // b
        cos, sin = model.rope.cos_sin_range(start, t, torch.float32 if cfg.rope.float32 else model.dtype, model.device)
        x = r.to(model.dtype)
        q, k, v = gqa_qkv(model.config, rms_norm(x, lp.input_norm, cfg.rms_norm_eps), b, t, cos, sin, lp)
        if start:  # the positions it holds (a sliding-window layer: its end, the window's mask relative)
            k = torch.cat([lay.buffers[0][:, :, : lay.held], k], 2)
            v = torch.cat([lay.buffers[1][:, :, : lay.held], v], 2)
        x = add_projection(x, attend(cfg, q, (k, v), target, cfg.head_dim**-0.5, lp.sinks), lp.o_proj)
        return rms_norm(x, lp.post_norm, cfg.rms_norm_eps).float()
