"""One decode token through the model with as few operators as the arithmetic allows.

Decode pays per operator, not per flop (the bundled model: ~500 operators a token, each's dispatch costing more
than its matmul; docs/measured-choices.md). This path runs every layer through the one layer function
(:func:`fate_edge.model.layer_step.decoder_layer`) with an attention made for one token of one sequence: rope as one
small matmul with a rotation built once per token (not four elementwise operators per layer; the one attention,
``attention.gqa``, takes it as ``rot``), or for bf16 on the CPU one native call with that matmul's bits
(``row_ops.RopeRows``), and the output projection added to the residual in the same matmul
(``addmm``). A bf16 row whose projections are native int4 takes the whole attention block as direct native calls
(:mod:`fate_edge.model.attention_row`, the same bits). Its routed experts come from the provider as on
the general path (:mod:`fate_edge.model.routed_experts`: one row calls its k experts directly). Where the provider
holds every expert in memory, a bf16 MoE layer whose parts are all on native kernels runs whole in one native call
(:mod:`fate_edge.model.decode_layer`, the same bits).

Layers it does not cover (MLA attention, OLMoE's q/k norm over all heads, clipped q/k/v, partial or interleaved rope)
go through the general path: :func:`supported` says which; Qwen3's per-head q/k norm it takes, before the rope.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fate_edge.model import attention_row
from fate_edge.model.attention import gqa
from fate_edge.model.decode_layer import DecodeLayers
from fate_edge.model.embedding import lookup
from fate_edge.model.layer import LayerPlan, head_logits, rms_norm
from fate_edge.model.layer_step import LayerPath, add_projection, decoder_layer, mlp_block
from fate_edge.model.routed_experts import provider_moe
from fate_edge.model.row_ops import RopeRows

if TYPE_CHECKING:
    from fate_edge.model.decoding_model import DecodingModel
    from fate_edge.model.kv_cache import KVCache


def supported(model: DecodingModel) -> bool:
    """Whether every layer of ``model`` can take this path (checked once per plan)."""
    cfg = model.config
    return (
        not cfg.recurrent
        and cfg.mla is None
        and cfg.qk_norm in ("none", "head")
        and cfg.clip_qkv is None
        and model.rope.dim == cfg.head_dim
    )


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
    rot: torch.Tensor | RopeRows | None = None
    if cos.dtype == x.dtype and not cfg.rope.interleaved:
        rot = RopeRows.of(x, cos, sin)  # on the CPU in bf16: one native call, the matrix's bits
    if rot is None and cos.dtype == x.dtype and not cfg.rope.interleaved:
        rot = rope_matrix(cos, sin, model.rope_permutation(cos.dtype))
        if x.device.type == "cpu" and x.dtype != torch.float32:
            # CPUs without native bf16 emulate a bf16 matmul, far slower than fp32 even with the casts
            # (docs/measured-choices.md); the fp32 product of bf16 values rounds back to the same bits
            rot = rot.float()

    def attend(x: torch.Tensor, h: torch.Tensor, layer: int, lp: LayerPlan) -> torch.Tensor:
        if isinstance(rot, RopeRows):  # a bf16 row on the CPU: the native calls on addresses, where they take it
            y = attention_row.attend(cfg, x, h, layer, lp, cache, rot)
            if y is not None:
                return y
        return add_projection(x, gqa(cfg, h, 1, 1, layer, lp, cache, cos, sin, rot), lp.o_proj)

    path = LayerPath(cfg, model.act, attend, provider_moe(model, decode=True))
    whole = DecodeLayers.of(model, cache, rot)  # a layer in one native call, where it takes the layer
    for i, lp in enumerate(plan):
        done = None if whole is None else whole.run(x, i, lp)
        if done is None:
            x = decoder_layer(path, x, i, lp)
        else:
            x, h = done
            if h is not None:  # the router declined (a tie): the MoE half as the general path computes it
                x = mlp_block(path, x, h, i, lp)
    x = rms_norm(x, model.w["model.norm.weight"], cfg.rms_norm_eps)
    return head_logits(x, model.head).view(1, 1, -1)
