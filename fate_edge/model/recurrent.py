"""Token mixers that keep a recurrent state instead of a KV cache, beside attention in the one layer function.

A layer's mixer is ``config.mixer(layer)``; :func:`mix` runs it on the layer's normed input and hands back the
output before the layer's output projection (which ``layer_step.add_projection`` adds, as for attention):

* "attention": grouped-query attention (``attention.gqa``) or MLA;
* "conv" (LFM2): ``in_proj`` → B, C, x; a depthwise causal convolution of ``conv_kernel`` over B·x; C times it;
* "linear_attention" (Qwen3-Next's gated DeltaNet): q, k, v through a causal convolution, then the gated delta
  rule (:mod:`fate_edge.model.delta_rule`, chunked over a prompt, recurrent for a decode token) from the layer's
  float32 matrix, which the update hands back beside the window (``Held(kind="delta")``) and the mixer overwrites.

Their state goes through the same ``AttentionState.update(layer, *new)`` as keys and values: the convolution's new
inputs [B, channels, T] in, the window (the last ``kernel - 1`` inputs, then the new ones) back as
``Held(kind="conv")`` (``kv_cache.RecurrentLayer``). A batch's update hands back its decode rows' states as one
part, stacked [rows, ...] (``RecurrentLayer.step_rows``: the mixer runs them as a batch, each row a sequence), and
each prompt chunk's as its own part, so a sequence's rows get the same state whether it steps alone or in a batch,
over a whole prompt or in chunks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from fate_edge.model import delta_rule
from fate_edge.model.attention import gqa, over_parts
from fate_edge.model.kv_cache import Held, RecurrentSpec
from fate_edge.model.layer import LayerPlan, apply_linear, rms_norm
from fate_edge.model.mla import mla

if TYPE_CHECKING:
    from fate_edge.model.arch.base import ModelConfig
    from fate_edge.model.kv_cache import AttentionState, Keys


def recurrent_specs(cfg: ModelConfig) -> dict[int, RecurrentSpec]:
    """The state shape of every recurrent layer of ``cfg``, by layer index."""
    out = {}
    for i in range(cfg.num_hidden_layers):
        kind = cfg.mixer(i)
        if kind == "conv":
            out[i] = RecurrentSpec("conv", cfg.hidden_size, cfg.conv_kernel)
        elif kind == "linear_attention":
            d = cfg.delta
            assert d is not None
            out[i] = RecurrentSpec("delta", d.conv_channels, cfg.conv_kernel, (d.value_heads, d.key_dim, d.value_dim))
    return out


def state_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes one sequence's recurrent states take over all layers (fixed, whatever its length)."""
    width = torch.empty(0, dtype=dtype).element_size()
    total = 0
    for s in recurrent_specs(cfg).values():
        total += s.channels * (s.kernel - 1) * width
        if s.matrix is not None:
            total += s.matrix[0] * s.matrix[1] * s.matrix[2] * 4  # float32
    return total


def mix(
    cfg: ModelConfig,
    h: torch.Tensor,
    b: int,
    t: int,
    layer: int,
    lp: LayerPlan,
    state: AttentionState,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """Layer ``layer``'s token mixer on normed ``h`` [B*T, H] → its output before the output projection."""
    if lp.mixer == "conv":
        return short_conv(h, b, t, layer, lp, state)
    if lp.mixer == "linear_attention":
        return gated_deltanet(cfg, h, b, t, layer, lp, state)
    if cfg.mla is not None:
        return mla(cfg, h, b, t, layer, lp, state, cos, sin)
    return gqa(cfg, h, b, t, layer, lp, state, cos, sin)


def short_conv(h: torch.Tensor, b: int, t: int, layer: int, lp: LayerPlan, state: AttentionState) -> torch.Tensor:
    """LFM2's gated short convolution: ``C * conv(B * x)`` [B*T, H], B, C and x from ``in_proj``."""
    gate_in, gate_out, x = apply_linear(h, lp.mix_in["in_proj"]).chunk(3, dim=-1)
    bx = (gate_in * x).view(b, t, -1).transpose(1, 2)  # [B, H, T]: the rows on dim 2, as the state takes them
    held = state.update(layer, bx)
    weight, bias = lp.mix["conv.weight"], lp.mix.get("conv.bias")
    if isinstance(held, Held) and held.parts is not None:  # a batch: each sequence over its own window
        return gate_out * over_parts(bx, held, lambda _, part: _conv(part, weight, bias))
    return gate_out * _conv(held, weight, bias)


def _conv(held: Keys, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The depthwise convolution over a state's window [B, C, K - 1 + T] → its T outputs as rows [B*T, C]."""
    assert isinstance(held, Held) and held.kind == "conv", "a convolution layer's state is a recurrent one"
    window = held.held[0]
    c = window.shape[1]
    out = F.conv1d(window.to(weight.dtype), weight, bias, groups=c)  # [B, C, T]: valid positions only
    return out.transpose(1, 2).reshape(-1, c).to(window.dtype)


def gated_deltanet(
    cfg: ModelConfig, h: torch.Tensor, b: int, t: int, layer: int, lp: LayerPlan, state: AttentionState
) -> torch.Tensor:
    """Qwen3-Next's gated DeltaNet on normed ``h`` [B*T, H] → [B*T, value heads * dv] before ``out_proj``: q, k, v
    through the causal convolution (silu), the gated delta rule from the layer's state, RMSNorm gated by silu(z)."""
    d = cfg.delta
    assert d is not None
    r, rows = d.value_heads // d.key_heads, h.shape[0]
    c = d.conv_channels
    if d.split_proj:  # Qwen3.5: [q; k; v] (each over all heads), z, b, a
        mixed, z, beta_in, a = apply_linear(h, lp.mix_in["in_proj"]).split_with_sizes(lp.mix_in["in_proj"].sizes, -1)
    else:  # Qwen3-Next: q, k, v, z and b, a grouped by key head
        qkvz = apply_linear(h, lp.mix_in["in_proj_qkvz"]).view(rows, d.key_heads, -1)
        q, k, v, z = qkvz.split([d.key_dim, d.key_dim, r * d.value_dim, r * d.value_dim], dim=-1)
        beta_in, a = apply_linear(h, lp.mix_in["in_proj_ba"]).view(rows, d.key_heads, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(rows, -1), k.reshape(rows, -1), v.reshape(rows, -1)], dim=-1)
    beta = beta_in.reshape(rows, -1).sigmoid()
    g = -lp.mix["A_log"].float().exp() * F.softplus(a.reshape(rows, -1).float() + lp.mix["dt_bias"])
    # one tensor with the rows on dim 2 (as the state takes them): what each sequence's part needs, sliced alike
    packed = torch.cat([mixed, beta.to(mixed.dtype), g.to(mixed.dtype)], dim=-1).view(b, t, -1).transpose(1, 2)
    held = state.update(layer, packed[:, :c])

    def run(x: torch.Tensor, part: Keys) -> torch.Tensor:
        assert isinstance(part, Held) and part.kind == "delta", "a DeltaNet layer's state is a recurrent one"
        window, matrix = part.held
        if window.shape[0] != x.shape[0]:  # a batch's decode rows stepped together: each row a sequence
            x = x.permute(2, 1, 0)
        n = x.shape[2]
        conv = F.silu(F.conv1d(window.to(lp.mix["conv1d.weight"].dtype), lp.mix["conv1d.weight"], groups=c))
        conv = conv.transpose(1, 2).to(x.dtype)  # [B, n, C]
        kq = d.key_heads * d.key_dim
        qn, kn = (y.reshape(x.shape[0], n, d.key_heads, d.key_dim) for y in (conv[..., :kq], conv[..., kq : 2 * kq]))
        vn = conv[..., 2 * kq :].reshape(x.shape[0], n, d.value_heads, d.value_dim)
        if r > 1:
            qn, kn = qn.repeat_interleave(r, dim=2), kn.repeat_interleave(r, dim=2)
        bn = x[:, c : c + d.value_heads].transpose(1, 2)
        gn = x[:, c + d.value_heads :].transpose(1, 2).float()
        rule = delta_rule.recurrent if n == 1 else delta_rule.chunked
        out, final = rule(qn, kn, vn, gn, bn, matrix)
        matrix.copy_(final)
        return out.to(x.dtype).reshape(-1, d.value_heads * d.value_dim)

    if isinstance(held, Held) and held.parts is not None:  # a batch: each sequence from its own state
        core = over_parts(packed, held, run)
    else:
        core = run(packed, held)
    core = rms_norm(core.reshape(-1, d.value_dim), lp.mix["norm.weight"], cfg.rms_norm_eps)
    core = (core * F.silu(z.reshape(-1, d.value_dim).float())).to(h.dtype)
    return core.reshape(rows, -1)
