"""Token mixers that keep a recurrent state instead of a KV cache, beside attention in the one layer function.

A layer's mixer is ``config.mixer(layer)``; :func:`mix` runs it on the layer's normed input and hands back the
output before the layer's output projection (which ``layer_step.add_projection`` adds, as for attention):

* "attention": grouped-query attention (``attention.gqa``) or MLA;
* "conv" (LFM2): ``in_proj`` → B, C, x; a depthwise causal convolution of ``conv_kernel`` over B·x; C times it.

Their state goes through the same ``AttentionState.update(layer, *new)`` as keys and values: the convolution's new
inputs [B, channels, T] in, the window (the last ``kernel - 1`` inputs, then the new ones) back as
``Held(kind="conv")`` (``kv_cache.RecurrentLayer``). A batch's update hands back one part per sequence, each run
over its own window, so a sequence's rows get the same state whether it steps alone or in a batch, over a whole
prompt or in chunks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from fate_edge.model.attention import gqa, over_parts
from fate_edge.model.kv_cache import Held, RecurrentSpec
from fate_edge.model.layer import LayerPlan, apply_linear
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
