"""One decode row's attention block on the CPU as direct calls into the native kernels: the q/k/v projection, rope
(with the projection's bias), the new key and value written into the cache, attention over it, the output
projection, then the residual add.

Why: through the general functions (``attention.gqa``: the projection's wrappers and views, rope's checks, the
cache's narrow-and-copy, the attention's dispatch and checks, ``add_projection``) a decode layer's attention paid
more Python around its kernels than the attention kernel itself took (docs/measured-choices.md); every one of those
checks is about shapes fixed for the whole run. Here they are made once per layer plan
(:class:`RowAttention`, kept on the plan and remade if its projections are replaced), and a token pays a few checks
of its cache and six calls on addresses.

Which rows: a bf16 row whose q/k/v and output projections are both on the native int4 kernel (a resident model's,
the default engine's), q/k/v in one matrix with a bf16 bias or none, plain GQA or Qwen3's per-head q/k norm (no
bias then; no clipping, output gate, sinks or sliding window), over a one-sequence cache layer with room for the
position. Anything else returns None and takes the general path, which computes the same bits operator by operator
(tests/test_attention_row.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fate_edge.model import decode_attention, row_ops
from fate_edge.model.kv_cache import KVCache, LayerCache
from fate_edge.quant.linear import QuantizedLinear
from fate_edge.quant.native import NativeInt4

if TYPE_CHECKING:
    from fate_edge.model.arch.base import ModelConfig
    from fate_edge.model.layer import LayerPlan
    from fate_edge.model.row_ops import RopeRows

BF16 = 2  # bytes


@dataclass
class RowAttention:
    """A layer's attention as :func:`attend` computes it, checked once."""

    qkv: NativeInt4  # [q; k; v] rows
    bias: torch.Tensor | None  # the projection's bf16 bias [(n_q + 2 n_k) head_dim], added in rope's call
    o: NativeInt4
    n_q: int
    n_k: int
    head_dim: int
    hidden: int
    q_norm: torch.Tensor | None = None  # Qwen3's per-head norms (bf16 [head_dim]), before rope; None: none
    k_norm: torch.Tensor | None = None
    eps: float = 0.0  # theirs


def plan_of(cfg: ModelConfig, lp: LayerPlan) -> RowAttention | None:
    """``lp``'s :class:`RowAttention`, or None where :func:`attend` does not take the layer; kept on the plan with the
    projections it was made from, made again if any of them was replaced."""
    qkv, o = lp.qkv, lp.o_proj
    weight, bias = (None, None) if qkv is None else (qkv.weight, qkv.bias)
    key = (qkv, o, weight, bias, o.weight, o.bias, lp.q_norm, lp.k_norm)
    held = lp.__dict__.get("_row_attention")
    if held is not None and all(a is b for a, b in zip(held[0], key)):
        return held[1]
    made = _make(cfg, lp)
    lp.__dict__["_row_attention"] = (key, made)
    return made


def _native(w: object) -> NativeInt4 | None:
    return w.native if isinstance(w, QuantizedLinear) else None


def _make(cfg: ModelConfig, lp: LayerPlan) -> RowAttention | None:
    qkv, o, hd = lp.qkv, lp.o_proj, cfg.head_dim
    if qkv is None or lp.sinks is not None or cfg.attn_output_gate or cfg.qk_norm not in ("none", "head"):
        return None
    if cfg.clip_qkv:
        return None
    norms = (lp.q_norm, lp.k_norm) if cfg.qk_norm == "head" else (None, None)
    if cfg.qk_norm == "head" and (qkv.bias is not None or not all(bf16_row(w, hd) for w in norms)):
        return None  # the bias would go before the norm, where rope's call adds it after; a weight of another kind
    wq, wo = _native(qkv.weight), _native(o.weight)
    if wq is None or wo is None or o.bias is not None or len(qkv.sizes) != 3:
        return None
    nq, nk, nv = qkv.sizes
    rows = nq + nk + nv
    bias = qkv.bias
    if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous() or bias.shape != (rows,)):
        return None  # rope adds a bf16 bias in its call; any other goes through the general path
    if nq % hd or nk % hd or nv != nk or hd % 8 or hd > 1024 or wq.shape[0] != rows or wo.shape[1] != nq:
        return None
    if wq.shape[1] != wo.shape[0] or not (decode_attention.available()[0] and row_ops.available()[0]):
        return None
    return RowAttention(wq, bias, wo, nq // hd, nk // hd, hd, wo.shape[0], *norms, cfg.rms_norm_eps)


def bf16_row(w: torch.Tensor | None, n: int) -> bool:
    """Whether ``w`` is a contiguous bf16 [n] (a norm's weight as the native calls read it)."""
    return w is not None and w.dtype == torch.bfloat16 and w.shape == (n,) and w.is_contiguous()


def attend(
    cfg: ModelConfig, x: torch.Tensor, h: torch.Tensor, layer: int, lp: LayerPlan, cache: KVCache, rot: RopeRows
) -> torch.Tensor | None:
    """``x + o_proj(attention(h))`` for one decode row (``x``, normed ``h`` [1, H] bf16), its key and value appended
    to ``cache``'s ``layer``, with the bits of ``decode_step``'s general path; None (nothing done) where the row, the
    layer or the cache is not one this takes."""
    plan = plan_of(cfg, lp)
    slot = None if plan is None else cache_slot(cfg, cache, layer, plan)
    if plan is None or slot is None:
        return None
    lay, kb, vb, at = slot
    hd = plan.head_dim
    if h.dtype != torch.bfloat16 or h.shape != (1, plan.hidden) or not h.is_contiguous() or h.device.type != "cpu":
        return None
    if x.dtype != torch.bfloat16:  # a float32 residual takes add_projection's one addmm
        return None
    rows = (plan.n_q + 2 * plan.n_k) * hd
    flat = torch.empty(1, rows, dtype=torch.bfloat16, device=h.device)
    fp = flat.data_ptr()
    plan.qkv.gemm_bf16(h.data_ptr(), 1, fp)
    if plan.q_norm is not None and plan.k_norm is not None:  # Qwen3: each head normed, then rotated
        row_ops.head_norm_at(fp, plan.n_q, plan.n_k, hd, plan.q_norm, plan.k_norm, plan.eps)
    bias, total = (None, 0) if plan.bias is None else (plan.bias.data_ptr(), rows)
    row_ops.rope_at(fp, plan.n_q + plan.n_k, rot, bias, total)
    k_at, v_at = fp + BF16 * plan.n_q * hd, fp + BF16 * (plan.n_q + plan.n_k) * hd
    ks, vs = kb.stride(), vb.stride()
    k_to, v_to = kb.data_ptr() + BF16 * at * ks[2], vb.data_ptr() + BF16 * at * vs[2]
    row_ops.kv_append(k_at, v_at, plan.n_k, BF16 * hd, k_to, BF16 * ks[1], v_to, BF16 * vs[1])
    lay.length += 1
    out = torch.empty(1, plan.n_q * hd, dtype=torch.bfloat16, device=h.device)
    decode_attention.attend_at(fp, plan.n_q, kb, vb, at + 1, hd**-0.5, out.data_ptr())
    y = torch.empty(1, plan.hidden, dtype=torch.bfloat16, device=h.device)
    plan.o.gemm_bf16(out.data_ptr(), 1, y.data_ptr())
    return x + y  # add_projection's bf16 rule: the projection rounded, then the sum


def cache_slot(
    cfg: ModelConfig, cache: KVCache, layer: int, plan: RowAttention
) -> tuple[LayerCache, torch.Tensor, torch.Tensor, int] | None:
    """Where a decode row's key and value go in ``cache``'s ``layer``: (the layer's cache, its key and value buffers,
    the position), or None where the cache is not one the native calls write (the general path takes it)."""
    if type(cache).update is not KVCache.update or layer in cfg.sliding_window_layers:
        return None
    lay = cache.layers[layer]
    if type(lay) is not LayerCache or lay.window is not None or len(lay.buffers) != 2:
        return None
    kb, vb = lay.buffers
    at = lay.held
    if at >= kb.shape[2] or not _cache_fits(kb, plan) or not _cache_fits(vb, plan):
        return None  # no room for the position (the general path grows the cache), or another kind of buffer
    return lay, kb, vb, at


def _cache_fits(b: torch.Tensor, plan: RowAttention) -> bool:
    """A one-sequence bf16 cache buffer [1, n_k, positions, head_dim] on the host, each position's row contiguous."""
    return (
        b.dtype == torch.bfloat16
        and b.dim() == 4
        and b.shape[0] == 1
        and b.shape[1] == plan.n_k
        and b.shape[3] == plan.head_dim
        and b.stride(3) == 1
        and b.device.type == "cpu"
    )
