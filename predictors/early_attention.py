"""Layer i+1's attention run one layer early, on layer i's residual: an estimate of layer i+1's gate input.

Layer i's gate input decides most of layer i+1's routing; most of the rest is decided by layer i+1's attention
over the other tokens (``scripts/predictor_ceiling.py``: everything a token's own residual holds before that
attention adds about one point). In decode that attention is mostly known when layer i routes: the keys and
values of every earlier token are already in layer i+1's KV cache; only the current token's own query, key and
value need its layer i+1 input, which does not exist until layer i's experts have run. So run layer i+1's
attention early, on layer i's post-attention residual r_i (the layer i+1 input minus layer i's expert output):

    q, k, v = qkv_{i+1}(input_norm_{i+1}(r_i))
    s = post_norm_{i+1}(r_i + o_{i+1}(attention(q, [K_{<t}, k], [V_{<t}, v])))

K_{<t}, V_{<t} being the true keys and values of the earlier positions. ``s`` is what layer i+1's router would
read if layer i's experts added nothing; a learned predictor reads [h_i, s] (``scripts/predictor_ceiling.py``
measures it). The price is one more attention per layer and token, on resident weights, while the reads fly.

Here the estimate is computed for recorded windows (training and scoring); every row attends to the true keys
and values of its window's earlier rows and to its own estimated ones (:func:`own_row_attention`), which is
exactly what a decode step would compute. The engine does not run it yet. GQA attention only (not MLA), and
only between adjacent layers (a dense layer in between would be skipped, not estimated).
"""

from __future__ import annotations

import torch

from fate_edge.fused import apply_linear, rms_norm
from fate_edge.kv_cache import KVCache


def own_row_attention(q: torch.Tensor, k_own: torch.Tensor, v_own: torch.Tensor, k_true: torch.Tensor,
                      v_true: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """Causal attention in which row t reads the true keys/values of rows < t and its own estimated ones.

    q [B, nh, T, d]; k_own, v_own, k_true, v_true [B, nkv, T, d] (nh a multiple of nkv) → [B*T, nh*d]."""
    rep = q.shape[1] // k_true.shape[1]
    k_own, v_own, k_true, v_true = (z.repeat_interleave(rep, 1) if rep > 1 else z
                                    for z in (k_own, v_own, k_true, v_true))
    t = q.shape[2]
    pos = torch.arange(t, device=q.device)
    earlier = pos[None, :] < pos[:, None]
    if window is not None:
        earlier &= pos[None, :] > pos[:, None] - window
    scores = (q @ k_true.transpose(-1, -2)).mul_(scale).masked_fill_(~earlier, float("-inf"))
    scores[..., pos, pos] = (q * k_own).sum(-1) * scale  # the diagonal: own query on own estimated key
    p = scores.float().softmax(-1).to(q.dtype)
    # Σ_{s<t} p_s v_s + p_t v_own_t: the true value at the diagonal swapped for the estimated one.
    out = p @ v_true + p[..., pos, pos].unsqueeze(-1) * (v_own - v_true)
    return out.transpose(1, 2).reshape(q.shape[0] * t, -1)


@torch.no_grad()
def early_attention(model, residual: torch.Tensor, true_input: torch.Tensor, target: int, seq_len: int,
                    batch: int = 8) -> torch.Tensor:
    """``s`` for layer ``target`` (module docstring) from ``residual`` [N, H] (the estimate of its input, one row
    per token) and ``true_input`` [N, H] (its real input before attention: the earlier rows' keys and values);
    rows window-major, ``seq_len`` a window → [N, H] float32."""
    cfg = model.config
    if cfg.mla is not None:
        raise ValueError("early attention runs GQA attention; MLA models (DeepSeek) are not supported")
    lp = model.plan()[target]
    eps, h = cfg.rms_norm_eps, cfg.hidden_size
    cos, sin = model.rope.cos_sin_range(0, seq_len, torch.float32 if cfg.rope.float32 else model.dtype)
    window = cfg.sliding_window if target in cfg.sliding_window_layers else None
    rows = batch * seq_len
    out = []
    for s in range(0, residual.shape[0], rows):
        r = residual[s : s + rows].to(model.dtype)
        x = true_input[s : s + rows].to(model.dtype)
        b = r.shape[0] // seq_len
        q, k, v = model.gqa_qkv(rms_norm(r, lp.input_norm, eps), b, seq_len, cos, sin, lp)
        _, k_true, v_true = model.gqa_qkv(rms_norm(x, lp.input_norm, eps), b, seq_len, cos, sin, lp)
        a = apply_linear(own_row_attention(q, k, v, k_true, v_true, cfg.head_dim**-0.5, window), lp.o_proj)
        out.append(rms_norm(r + a, lp.post_norm, eps).float().reshape(-1, h))
    return torch.cat(out)


@torch.no_grad()
def post_attention_residual(model, layer_input: torch.Tensor, layer: int, seq_len: int,
                            batch: int = 8) -> torch.Tensor:
    """Layer ``layer``'s residual after its own attention, r = x + attention(input_norm(x)), for its inputs
    ``layer_input`` [N, H] (rows window-major, every window from position 0) → [N, H] float32."""
    cfg = model.config
    lp = model.plan()[layer]
    cos, sin = model.rope.cos_sin_range(0, seq_len, torch.float32 if cfg.rope.float32 else model.dtype)
    rows = batch * seq_len
    out = []
    for s in range(0, layer_input.shape[0], rows):
        x = layer_input[s : s + rows].to(model.dtype)
        b = x.shape[0] // seq_len
        cache = KVCache(cfg.num_hidden_layers)
        a = model._gqa_attention(rms_norm(x, lp.input_norm, cfg.rms_norm_eps), b, seq_len, 0, cache, layer,
                                 cos, sin, lp)
        out.append((x + a).float())
    return torch.cat(out)


def early_gate_inputs(model, inputs: dict[int, torch.Tensor], seq_len: int) -> dict[int, torch.Tensor]:
    """Per MoE layer i followed directly by an MoE layer i+1: ``s`` for i+1 from i's residual (module docstring).
    ``inputs`` holds every layer's input before attention [N, H] (transformers' ``output_hidden_states``)."""
    moe = model.config.moe_layers
    out = {}
    for i in moe:
        if i + 1 in moe and i in inputs and i + 1 in inputs:
            residual = post_attention_residual(model, inputs[i], i, seq_len)
            out[i] = early_attention(model, residual, inputs[i + 1], i + 1, seq_len)
    return out
