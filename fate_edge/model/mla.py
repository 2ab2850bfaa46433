"""Multi-head latent attention (DeepSeek-V2/V3), written once for every forward path that runs it: prompts, the
decode step and batched steps (the compiled and captured steps take GQA models only).

:func:`mla` projects q and the latent, writes the latent through the layer's state (``state.update``: any
:class:`~fate_edge.model.kv_cache.AttentionState`; MLA caches the normed latent and the rotated rope key side by
side, one "head" of kv_lora_rank + rope dims a position, not per-head keys and values) and attends over what the
update hands back, by its kind (:func:`attend`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from fate_edge.model import attention, decode_attention, head_matvec, sdpa
from fate_edge.model.kv_cache import Held
from fate_edge.model.layer import LayerPlan, apply_linear, rms_norm
from fate_edge.model.rope import apply_rope, yarn_softmax_scale

if TYPE_CHECKING:
    from fate_edge.model.arch.base import ModelConfig
    from fate_edge.model.kv_cache import AttentionState, Keys, RowRanges


def mla(
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
    """Normed ``h`` [B*T, H] → the attention's output before its projection [B*T, heads * v_head_dim], the latent
    written through ``state``."""
    q, latent = mla_qkv(cfg, h, b, t, cos, sin, lp)
    return attend(cfg, q, state.update(layer, latent), layer, lp)


def mla_qkv(cfg: ModelConfig, x, b: int, t: int, cos, sin, lp: LayerPlan):
    """Normed ``x`` [B*T, H] → q [B, heads, T, nope + rope] (rotated), and what MLA caches per position: the
    normed latent and the rotated rope key side by side, [B, 1, T, kv_lora_rank + rope dims]."""
    m = cfg.mla
    assert m is not None and lp.k_norm is not None  # MLA's plan holds its latent norms as q_norm and k_norm
    x = x.view(b, t, -1)
    qk_head = m.qk_nope_head_dim + m.qk_rope_head_dim
    if m.q_lora_rank is None:
        q = apply_linear(x, lp.mla["q_proj"])
    else:
        assert lp.q_norm is not None
        q_lat = rms_norm(apply_linear(x, lp.mla["q_a_proj"]), lp.q_norm, 1e-6)
        q = apply_linear(q_lat, lp.mla["q_b_proj"])
    q = q.view(b, t, -1, qk_head).transpose(1, 2)
    q_nope, q_rot = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
    kv_lat, k_rot = apply_linear(x, lp.mla["kv_a_proj_with_mqa"]).split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
    kv_lat = rms_norm(kv_lat, lp.k_norm, 1e-6).view(b, 1, t, m.kv_lora_rank)
    k_rot = k_rot.view(b, 1, t, m.qk_rope_head_dim)
    q_rot = apply_rope(q_rot, cos, sin, cfg.rope.interleaved)
    k_rot = apply_rope(k_rot, cos, sin, cfg.rope.interleaved)
    return torch.cat([q_nope, q_rot], dim=-1), torch.cat([kv_lat, k_rot], dim=-1)


def attend(cfg: ModelConfig, q: torch.Tensor, held: Keys, layer: int, lp: LayerPlan) -> torch.Tensor:
    """q [B, heads, T, nope + rope] over what a state update handed back (latents and rope keys [B, 1, S,
    kv_lora_rank + rope]) → [B*T, heads * v_head_dim], by the kind of state.

    A decode position with a dense ``kv_b_proj`` attends in the latent space (DeepSeek-V2's absorbed form):
    q's no-rope part goes through each head's key block of ``kv_b_proj`` once, the scores are taken against the
    cached latents themselves (one key "head" shared by every query head, as MQA), and the weighted latent goes
    through the head's value block once. Expanding the cache instead costs ``kv_b_proj`` on every cached
    position at every token: DeepSeek-V2-Lite's 512 x 4096 per position and layer, 2 GFLOP a layer at 1,000
    positions. Prompts expand, as does a ``kv_b_proj`` quantized at convert by an older fate-edge (no quantized
    kernel multiplies from that side; ``layer.resident_groups`` now keeps it in the model's dtype)."""
    if type(held) is not tuple:  # a batch's parts, or a slab's decode rows
        assert isinstance(held, Held)
        if held.parts is not None:
            return attention.over_parts(q, held, lambda qp, hp: attend(cfg, qp, hp, layer, lp))
        assert held.rows is not None
        return _slab_rows(cfg, q, held, held.rows, layer, lp)
    m = cfg.mla
    assert m is not None
    (latent,) = held
    r, nope, dv = m.kv_lora_rank, m.qk_nope_head_dim, m.v_head_dim
    kv_b = lp.mla["kv_b_proj"]
    dense = isinstance(kv_b.weight, torch.Tensor) and kv_b.bias is None
    # CPUs without native bf16 emulate a bf16 GEMM, far slower than fp32 at a prompt's size
    # (docs/measured-choices.md); the fp32 products of bf16 values are exact, rounded once on the way back
    widen = dense and q.device.type == "cpu" and q.dtype != torch.float32
    if q.shape[2] == 1 and dense:
        assert isinstance(kv_b.weight, torch.Tensor)
        return _absorbed(cfg, q, latent, kv_b.weight, widen)
    b, s = latent.shape[0], latent.shape[2]
    kv_lat, k_rot = latent.split([r, m.qk_rope_head_dim], dim=-1)
    if widen:
        assert isinstance(kv_b.weight, torch.Tensor)
        kv = F.linear(kv_lat.float(), kv_b.weight.float()).to(q.dtype)
    else:
        kv = apply_linear(kv_lat, kv_b)
    kv = kv.view(b, s, -1, nope + dv).transpose(1, 2)
    k_nope, v = kv.split([nope, dv], dim=-1)
    k = torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
    return attention.attend(cfg, q, (k, v), layer, scale(cfg))


def _absorbed(cfg: ModelConfig, q, latent, weight: torch.Tensor, widen: bool) -> torch.Tensor:
    """:func:`attend` for one decode position per sequence, in the latent space; ``weight``: the dense
    ``kv_b_proj``. On the CPU in bf16/fp16 the per-head products run in fate-edge's kernel (``head_matvec``: each
    weight read once, fp32 arithmetic); elsewhere in torch (widened to fp32 on the CPU: ``widen``)."""
    m = cfg.mla
    assert m is not None
    r, nope, dv = m.kv_lora_rank, m.qk_nope_head_dim, m.v_head_dim
    b, heads = q.shape[0], q.shape[1]
    wk, wv = blocks(cfg, weight, heads)
    sc = scale(cfg)
    if b == 1 and head_matvec.takes(wk):
        q_lat = latent_queries(cfg, q[:, :, 0], wk)[:, :, None]  # [1, heads, 1, r + rope]
        o = sdpa.attention(q_lat, latent, latent[..., :r], scale=sc, enable_gqa=heads > 1)
        return latent_values(o[:, :, 0], wv)
    q_nope, q_rot = q.split([nope, m.qk_rope_head_dim], dim=-1)
    if widen:
        q_lat = torch.matmul(q_nope.float(), wk.float()).to(q.dtype)
    else:
        q_lat = torch.matmul(q_nope, wk)
    q_lat = torch.cat([q_lat, q_rot], dim=-1)  # [B, heads, 1, r + rope]
    o = sdpa.attention(q_lat, latent, latent[..., :r], scale=sc, enable_gqa=heads > 1)  # [B, heads, 1, r]
    return torch.matmul(o, wv.transpose(1, 2)).reshape(b, heads * dv)


def _slab_rows(cfg: ModelConfig, q: torch.Tensor, held: Held, d: RowRanges, layer: int, lp: LayerPlan) -> torch.Tensor:
    """One decode query per sequence of a slab (``q`` [1, heads, S, nope + rope], the rows' own), absorbed in one pass
    where the CPU kernels take them: every row's query through each head's key block of ``kv_b_proj`` with the block
    read once (``head_matvec``), one attention over the rows' own ranges, one pass through the value blocks →
    [S, heads * v_head_dim], each row as it decodes alone. Elsewhere each row over its own range, one by one."""
    m = cfg.mla
    assert m is not None
    kv_b = lp.mla["kv_b_proj"]
    r, heads = m.kv_lora_rank, q.shape[1]
    cache = held.held[0][0]  # [1, positions, r + rope]: MLA's one key "head"
    if isinstance(kv_b.weight, torch.Tensor) and kv_b.bias is None:
        wk, wv = blocks(cfg, kv_b.weight, heads)
        probe = q.new_empty(1, heads, r + m.qk_rope_head_dim)
        if head_matvec.takes(wk) and decode_attention.takes_ranges(probe, cache, cache[..., :r]):
            q_lat = latent_queries(cfg, q[0].transpose(0, 1), wk)  # [S, heads, r + rope]
            o = decode_attention.attend_ranges(q_lat, cache, cache[..., :r], *d.ranges(None), scale(cfg))
            return latent_values(o, wv)
    return torch.cat([attend(cfg, q[:, :, i : i + 1], one, layer, lp) for i, one in enumerate(d.views(layer))])


def blocks(cfg: ModelConfig, weight: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense ``kv_b_proj``'s per-head key rows [heads, nope, r] and value rows [heads, v_head_dim, r] (views)."""
    m = cfg.mla
    assert m is not None
    w = weight.view(heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)  # per head: key rows, value rows
    return w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :]


def latent_queries(cfg: ModelConfig, q: torch.Tensor, wk: torch.Tensor) -> torch.Tensor:
    """Decode queries [V, heads, nope + rope] into the latent space, [V, heads, r + rope]: each head's no-rope
    part through its key block (``head_matvec``), the rope part as it is. Check ``head_matvec.takes`` first."""
    m = cfg.mla
    assert m is not None
    q_nope, q_rot = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
    return torch.cat([head_matvec.x_w(q_nope, wk).to(q.dtype), q_rot], dim=-1)


def latent_values(o: torch.Tensor, wv: torch.Tensor) -> torch.Tensor:
    """Weighted latents [V, heads, r] through each head's value block (``head_matvec``) → [V, heads * v_head_dim]
    in o's dtype."""
    return head_matvec.w_x(o, wv).to(o.dtype).reshape(o.shape[0], -1)


def scale(cfg: ModelConfig) -> float:
    """MLA's softmax scale: 1 / sqrt(the query-key width), times YaRN's attention factor where it applies."""
    m = cfg.mla
    assert m is not None
    return (m.qk_nope_head_dim + m.qk_rope_head_dim) ** -0.5 * yarn_softmax_scale(cfg.rope)
