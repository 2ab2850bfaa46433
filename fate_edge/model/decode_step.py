"""One decode token through the model with as few operators as the arithmetic allows.

Decode pays per operator, not per flop (the bundled model: ~500 operators a token, each a few µs of dispatch,
against ~1 µs of matmul). This path runs every layer through the one layer function
(:func:`fate_edge.model.layer_step.decoder_layer`) with an attention made for one token of one sequence: rope as one
small matmul with a rotation built once per token (not four elementwise operators per layer), and the output
projection added to the residual in the same matmul (``addmm``). Its routed experts come from the provider as on
the general path (:mod:`fate_edge.model.routed_experts`: one row calls its k experts directly).

Layers it does not cover (MLA attention, q/k norms, clipped q/k/v, partial or interleaved rope) go through the
general path: :func:`supported` says which.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fate_edge.model import sdpa
from fate_edge.model.embedding import lookup
from fate_edge.model.layer import LayerPlan, apply_linear, rms_norm
from fate_edge.model.layer_step import LayerPath, add_projection, decoder_layer
from fate_edge.model.rope import apply_rope
from fate_edge.model.routed_experts import provider_moe

if TYPE_CHECKING:
    from fate_edge.model.decoding_model import DecodingModel
    from fate_edge.model.kv_cache import KVCache


def supported(model: DecodingModel) -> bool:
    """Whether every layer of ``model`` can take this path (checked once per plan)."""
    cfg = model.config
    return cfg.mla is None and cfg.qk_norm == "none" and cfg.clip_qkv is None and model.rope.dim == cfg.head_dim


def rope_matrix(cos: torch.Tensor, sin: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """R [d, d] with ``x @ R == x * cos + x.roll(d / 2, -1) * sin`` for one position (``cos``/signed ``sin`` [1, d]).

    ``perm`` [d, d] holds 1 at (j + d/2 mod d, j): the column j picks x_j times cos_j and its rolled partner times
    sin_j; every other product is an exact zero, so the sum is the elementwise rotation's up to one rounding.
    """
    return torch.diag(cos[0]).addcmul_(perm, sin)


def roll_permutation(d: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    half = d // 2
    p = torch.zeros(d, d, dtype=dtype, device=device)
    j = torch.arange(d, device=device)
    p[(j + half) % d, j] = 1
    return p


def decode_token(model: DecodingModel, token: torch.Tensor, cache: KVCache, plan: list[LayerPlan]) -> torch.Tensor:
    """``token`` [1, 1] continuing ``cache`` → logits [1, 1, V]."""
    cfg = model.config
    start = cache.length
    x = lookup(model.embed, token.view(1))  # [1, H]
    cos, sin = model.rope.cos_sin_range(start, 1, torch.float32 if cfg.rope.float32 else model.dtype, x.device)
    rot = None
    if cos.dtype == x.dtype and not cfg.rope.interleaved:
        rot = rope_matrix(cos, sin, model.rope_permutation(cos.dtype))
        if x.device.type == "cpu" and x.dtype != torch.float32:
            # CPUs without native bf16 emulate a bf16 matmul (32 x 128 rows of Qwen1.5-MoE: 350 µs against 20 in
            # fp32, casts included); the fp32 product of bf16 values rounds back to the same bits
            rot = rot.float()

    def attend(x: torch.Tensor, h: torch.Tensor, layer: int, lp: LayerPlan) -> torch.Tensor:
        return attention(model, x, h, start, cache, layer, lp, cos, sin, rot)

    path = LayerPath(cfg, model.act, attend, provider_moe(model, decode=True))
    for i, lp in enumerate(plan):
        x = decoder_layer(path, x, i, lp)
    x = rms_norm(x, model.w["model.norm.weight"], cfg.rms_norm_eps)
    return apply_linear(x, model.head).view(1, 1, -1)


def attention(
    model: DecodingModel,
    x: torch.Tensor,
    h: torch.Tensor,
    start: int,
    cache: KVCache,
    layer: int,
    lp: LayerPlan,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rot: torch.Tensor | None,
) -> torch.Tensor:
    """``x + o_proj(attention(h))`` for one token; its k and v are appended to ``cache``."""
    cfg = model.config
    hd = cfg.head_dim
    assert lp.qkv is not None  # GQA (supported() excludes MLA)
    qkv = apply_linear(h, lp.qkv).view(-1)  # [(nq + 2 nk) hd]
    n_q, n_k = lp.qkv.sizes[0] // hd, lp.qkv.sizes[1] // hd
    # narrow, not [a:b]: a slice costs ~2.5 µs to dispatch from Python, narrow ~1 µs (four a layer, every token)
    qk = qkv.narrow(0, 0, (n_q + n_k) * hd).view(n_q + n_k, hd)
    if rot is not None:
        qk = qk @ rot if rot.dtype == qk.dtype else torch.mm(qk.float(), rot).to(qk.dtype)
    else:
        qk = apply_rope(qk.view(1, n_q + n_k, 1, hd), cos, sin, cfg.rope.interleaved).view(n_q + n_k, hd)
    q = qk.narrow(0, 0, n_q).view(1, n_q, 1, hd)
    k, v = cache.layers[layer].append(
        qk.narrow(0, n_q, n_k).view(1, n_k, 1, hd),
        qkv.narrow(0, (n_q + n_k) * hd, n_k * hd).view(1, n_k, 1, hd),
        capacity_hint=cache.capacity_hint,
    )
    if layer in cfg.sliding_window_layers and cfg.sliding_window is not None:
        first = max(0, k.shape[2] - cfg.sliding_window)  # keys at positions > start - window
        k, v = k[:, :, first:], v[:, :, first:]
    out = sdpa.attention(q, k, v, scale=hd**-0.5, enable_gqa=n_q != n_k).view(1, n_q * hd)
    return add_projection(x, out, lp.o_proj)
