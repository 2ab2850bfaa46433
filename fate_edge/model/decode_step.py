"""One decode token through the model with as few operators as the arithmetic allows.

Decode pays per operator, not per flop (the bundled model: ~500 operators a token, each a few µs of dispatch,
against ~1 µs of matmul). This path computes what :meth:`MoETransformer.forward` computes for one token of one
sequence, with fewer and larger operators: rope as one small matmul with a rotation built once per token (not
four elementwise operators per layer), the attention output projection added to the residual in the same
matmul (``addmm``), routed experts and the shared expert accumulated into the residual in place (expert-id
order, as the multi-token path sums them), and int4 experts fed one bf16 copy of the gate input per layer
(tinygemm takes bf16) instead of a cast per matmul. Results equal the general path's to rounding (the
parity tests hold both to the same tolerances).

Layers it does not cover (MLA attention, q/k norms, clipped q/k/v, partial or interleaved rope) go through the
general path: :func:`supported` says which.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fate_edge.model import sdpa
from fate_edge.model.embedding import lookup
from fate_edge.model.experts import QuantizedExpert
from fate_edge.model.layer import Fused, LayerPlan, apply_linear, rms_norm
from fate_edge.model.rope import apply_rope

if TYPE_CHECKING:
    from collections.abc import Callable

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
    x = lookup(model.embed, token.view(1))  # [1, H]; a fresh tensor, updated in place below
    cos, sin = model.rope.cos_sin_range(start, 1, torch.float32 if cfg.rope.float32 else model.dtype, x.device)
    rot = None
    if cos.dtype == x.dtype and not cfg.rope.interleaved:
        rot = rope_matrix(cos, sin, model.rope_permutation(cos.dtype))
    eps = cfg.rms_norm_eps
    for i, lp in enumerate(plan):
        h = rms_norm(x, lp.input_norm, eps)
        attention(model, x, h, start, cache, i, lp, cos, sin, rot)
        h = rms_norm(x, lp.post_norm, eps)
        if lp.router is not None:
            moe(model, x, h, i, lp)
        else:
            assert lp.mlp is not None and lp.down is not None  # a dense layer's MLP
            mlp_into(model, x, h, lp.mlp, lp.down)
    x = rms_norm(x, model.w["model.norm.weight"], eps)
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
) -> None:
    """``x += o_proj(attention(h))`` for one token; its k and v are appended to ``cache``."""
    cfg = model.config
    hd = cfg.head_dim
    assert lp.qkv is not None  # GQA (supported() excludes MLA)
    qkv = apply_linear(h, lp.qkv)  # [1, (nq + 2 nk) hd]
    n_q, n_k = lp.qkv.sizes[0] // hd, lp.qkv.sizes[1] // hd
    qk = qkv[0, : (n_q + n_k) * hd].view(n_q + n_k, hd)
    if rot is not None:
        qk = qk @ rot
    else:
        qk = apply_rope(qk.view(1, n_q + n_k, 1, hd), cos, sin, cfg.rope.interleaved).view(n_q + n_k, hd)
    q = qk[:n_q].view(1, n_q, 1, hd)
    k, v = cache.layers[layer].append(
        qk[n_q:].view(1, n_k, 1, hd), qkv[0, (n_q + n_k) * hd :].view(1, n_k, 1, hd), capacity_hint=cache.capacity_hint
    )
    if layer in cfg.sliding_window_layers and cfg.sliding_window is not None:
        first = max(0, k.shape[2] - cfg.sliding_window)  # keys at positions > start - window
        k, v = k[:, :, first:], v[:, :, first:]
    out = sdpa.attention(q, k, v, scale=hd**-0.5, enable_gqa=n_q != n_k).view(1, n_q * hd)
    o = lp.o_proj
    if isinstance(o.weight, torch.Tensor) and o.bias is None:
        torch.addmm(x, out, o.weight.t(), out=x)  # residual and projection in one matmul
    else:
        x.add_(apply_linear(out, o))


def moe(model: DecodingModel, x: torch.Tensor, h: torch.Tensor, layer: int, lp: LayerPlan) -> None:
    """``x += Σ w_e · expert_e(h) (+ shared expert)`` for one token; experts summed in expert-id order.

    The shared expert is computed before the routed ones but added after them, as before: the observers have
    just issued the layer's demand reads, which then arrive while it computes (a Qwen1.5-MoE shared expert is
    ~1.5 ms of a ~5 ms read), and the sums keep their order, so the bits are the same."""
    weights, idx = model.route(layer, h)  # [1, k]
    serve_routing(
        model,
        x,
        h,
        layer,
        weights,
        idx,
        lambda: shared_out(model, h, lp.mlp, lp.down) if lp.mlp is not None and lp.down is not None else None,
    )


def serve_routing(
    model: DecodingModel,
    x: torch.Tensor,
    h: torch.Tensor,
    layer: int,
    weights: torch.Tensor,
    idx: torch.Tensor,
    shared: Callable[[], tuple[torch.Tensor, torch.Tensor | None] | None],
) -> None:
    """After one token's routing: the observers (the scheduler's reads), then ``shared()`` (computed while the
    reads travel, or already computed by a layer graph), the routed experts into ``x``, the shared expert last."""
    if h.device.type != "cpu":
        weights, idx = routing_to_host(weights, idx)
    model.residual = x
    for obs in model.observers:
        obs(layer, h, idx, weights)
    z = shared()
    add_experts(model, x, h, None, layer, weights, idx)
    if z is not None:
        add_shared(x, *z)


def routing_to_host(weights: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A GPU layer's routing on the host in one copy (the layer's one sync): the observers and the expert loop
    then read Python numbers, where each ``tolist``/``unique`` of a GPU tensor would wait on the GPU again.
    Expert ids travel as float32, exact below 2**24."""
    k = weights.shape[1]
    both = torch.cat([weights.float(), idx.float()], dim=1).cpu()
    return both[:, :k], both[:, k:].long()


def add_experts(
    model: DecodingModel,
    x: torch.Tensor,
    h: torch.Tensor,
    hb: torch.Tensor | None,
    layer: int,
    weights: torch.Tensor,
    idx: torch.Tensor,
) -> None:
    """``x += Σ w_e · expert_e(h)`` over the token's routed experts (``hb``: ``h`` in bf16, made when None)."""
    weight_of = dict(zip(idx.tolist()[0], weights.tolist()[0]))
    parts: dict[int, torch.Tensor] = {}
    for e, expert in model.experts.stream(layer, sorted(weight_of)):
        if expert is None:  # skipped by precision-on-miss (opt-in)
            continue
        if isinstance(expert, QuantizedExpert) and expert.takes_bf16:
            if hb is None:  # one bf16 copy of h for every int4 expert of the layer
                hb = h.to(torch.bfloat16)
            parts[e] = expert.forward_bf16(hb)
        else:
            parts[e] = expert(h)
    model.experts.end_layer(layer)
    for e in sorted(parts):  # whatever order they arrived in
        x.add_(parts[e], alpha=weight_of[e])


def mlp_into(model: DecodingModel, x: torch.Tensor, h: torch.Tensor, mlp: Fused, down: Fused) -> None:
    """``x += mlp(h)``: a dense MLP or shared expert (Qwen's gated one: ``x += sigmoid(g(h)) * mlp(h)``)."""
    add_shared(x, *shared_out(model, h, mlp, down))


def shared_out(
    model: DecodingModel, h: torch.Tensor, mlp: Fused, down: Fused
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A dense MLP's or shared expert's output ``mlp(h)`` and Qwen's gate logit (None without one), not yet added."""
    y = apply_linear(h, mlp)
    gate, up, *gated = y.split(mlp.sizes, dim=-1)
    return apply_linear(model.act(gate) * up, down), (gated[0] if gated else None)


def add_shared(x: torch.Tensor, z: torch.Tensor, gate: torch.Tensor | None) -> None:
    """``x += z``, or ``x += sigmoid(gate) * z`` for Qwen's gated shared expert."""
    if gate is not None:
        x.addcmul_(torch.sigmoid(gate), z)
    else:
        x.add_(z)
