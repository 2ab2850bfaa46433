"""One decoder layer, the same function for every way a forward pass runs: eagerly over a prompt or a batch
(``transformer``, ``batch_step``), eagerly for one decode token (``decode_step``), compiled (``compiled_step``)
or captured as CUDA graphs (``graph_step``).

The paths differ only where their state lives, so a :class:`LayerPath` carries those two parts:

* ``attention``: where the keys and values are (a cache that grows, a whole-capacity static buffer, one cache
  per sequence of a batch) → the residual plus the attention's output projection;
* ``moe``: where the routed experts come from (the expert provider, whose reads the observers issue, or per-layer
  stacks picked inside a graph) → the residual plus the routed experts and the shared expert.

Everything else, and every rule for adding into the residual, is here once:

* the output projection is added by :func:`add_projection` (one ``addmm`` in float32);
* a layer's routed experts are summed by :func:`add_routed` in expert-id order, in float32, then the shared expert
  (:func:`add_shared`, Qwen's gate in one ``addcmul``). The sum starts where :func:`moe_sum` says: in a float32
  model, at the residual itself (each expert a fused multiply-add into it); in a bf16 model, at zero in a float32
  accumulator added to the residual once (:func:`add_moe`), so bf16 rounds once per layer where the reference
  models round each bf16 add. One rule on every path: a token gets the same sums, bit for bit, decoded alone, in a
  batch or in a prompt (given the same expert outputs), whatever order its experts arrived in;
* the shared expert is computed before the routed ones (the layer's reads travel meanwhile); a dense MLP's output
  is added to the residual directly (:func:`add_mlp`);
* an expert's output comes from :func:`expert_rows` on every path, by the row's role. An int4 expert on torch's
  kernel computes a decode token's row in bf16 from one bf16 copy of the layer's rows (the kernel's dtype: casting
  in and out at each matmul doubled an expert's time in a decode step: docs/measured-choices.md) and
  a prompt's rows in the activations' dtype between its matmuls (the casts cost per call, not per row, so a prompt
  keeps float32's precision for free); any other expert computes in the activations' dtype. The role, not the
  path, decides, so a decode row gets the same bits alone, in a batch or beside a joining prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from fate_edge.model import native_router
from fate_edge.model.layer import Fused, LayerPlan, apply_linear, rms_norm
from fate_edge.model.router import route

if TYPE_CHECKING:
    from fate_edge.model.arch.base import ModelConfig

# (x, normed h, layer, plan) → x + o_proj(attention(h))
Attention = Callable[[torch.Tensor, torch.Tensor, int, LayerPlan], torch.Tensor]
# (x, gate input h, layer, plan, weights [N, k], expert ids [N, k]) → x + routed experts + shared expert
Moe = Callable[[torch.Tensor, torch.Tensor, int, LayerPlan, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class LayerPath:
    """The parts of a layer that depend on where a path keeps its KV cache and its experts."""

    config: ModelConfig
    act: Callable[[torch.Tensor], torch.Tensor]
    attention: Attention
    moe: Moe


def decoder_layer(path: LayerPath, x: torch.Tensor, layer: int, lp: LayerPlan) -> torch.Tensor:
    """Residual ``x`` [N, H] through decoder layer ``layer`` → [N, H] (``x`` may be updated in place)."""
    eps = path.config.rms_norm_eps
    h = rms_norm(x, lp.input_norm, eps)
    x = path.attention(x, h, layer, lp)
    return mlp_block(path, x, rms_norm(x, lp.post_norm, eps), layer, lp)


def mlp_block(path: LayerPath, x: torch.Tensor, h: torch.Tensor, layer: int, lp: LayerPlan) -> torch.Tensor:
    """The layer's second half: the residual ``x`` plus its dense MLP or its MoE block on the normed ``h``."""
    if lp.router is None:
        assert lp.mlp is not None and lp.down is not None  # a layer without a router has a dense MLP
        return add_mlp(x, h, lp.mlp, lp.down, path.act)
    weights, idx = router_block(path.config, h, lp)
    return path.moe(x, h, layer, lp, weights, idx)


def router_block(cfg: ModelConfig, h: torch.Tensor, lp: LayerPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's router on gate input ``h`` [N, H] → (weights [N, k] float32, expert ids [N, k]): a softmax
    router on the CPU in one native call (:mod:`~fate_edge.model.native_router`), else torch's operators."""
    assert lp.router is not None  # an MoE layer
    if lp.correction_bias is None and native_router.takes(cfg, h, lp.router, lp.router_bias):
        routed = native_router.route_softmax(cfg, h, lp.router)
        if routed is not None:  # None: a tie in some row's top k, which torch.topk decides
            return routed
    logits = F.linear(h if h.dtype == lp.router.dtype else h.to(lp.router.dtype), lp.router, lp.router_bias)
    return route(cfg, logits, lp.correction_bias)


def add_projection(x: torch.Tensor, out: torch.Tensor, o: Fused) -> torch.Tensor:
    """``x + o(out)``. float32: the residual and a dense bias-free projection in one ``addmm``. Lower precisions
    round the projection, then the sum, as the reference models do: one ``addmm`` there is nearer the exact value
    but 1.5x as far from transformers' bf16 logits (2.3e-2 against 1.6e-2 on the parity models, measured)."""
    if x.dtype == torch.float32 and isinstance(o.weight, torch.Tensor) and o.bias is None:
        return torch.addmm(x, out, o.weight.t())
    return x + apply_linear(out, o)


def moe_sum(x: torch.Tensor) -> torch.Tensor | None:
    """Where a MoE layer's float32 expert sum starts: the residual ``x`` itself when it is float32, else None (a
    float32 accumulator from zero, made by the first :func:`add_routed`)."""
    return x if x.dtype == torch.float32 else None


def add_routed(acc: torch.Tensor | None, y: torch.Tensor, w: torch.Tensor | float) -> torch.Tensor:
    """A layer's float32 expert sum with one more routed expert: ``acc + w · y``, ``acc`` updated in place (None:
    a new accumulator, from zero). ``y`` [N, H] are the expert's rows in any float dtype; ``w`` their float32
    weights [N, 1] (or [1] for one row), a tensor where a graph keeps them on the device, or one row's weight as a
    Python float where eager code has it on the host (cheaper to dispatch). On a float32 ``acc`` both forms round
    alike, product and fused multiply-add (``tests/test_waste.py`` checks the bits), which a bf16 one would not."""
    if isinstance(w, float):
        if acc is None:  # 0 + w·y is the float32 product's rounding, without y * w's wrapping of w
            acc = torch.zeros_like(y, dtype=torch.float32)
        return acc.add_(y, alpha=w)
    return y * w if acc is None else acc.addcmul_(y, w)


def add_shared(acc: torch.Tensor | None, z: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """The expert sum plus the shared expert ``z`` (Qwen's gated one: ``sigmoid(gate) * z``), in float32."""
    if acc is None:  # no routed expert ran (precision-on-miss skipped them all)
        return z.float() if gate is None else torch.sigmoid(gate.float()) * z
    return acc.addcmul_(torch.sigmoid(gate), z) if gate is not None else acc.add_(z)


def add_moe(x: torch.Tensor, acc: torch.Tensor | None) -> torch.Tensor:
    """The residual with a MoE layer's expert sum in it: already there when the sum started at ``x`` (float32),
    else the float32 accumulator added once, one rounding to ``x``'s dtype."""
    return x if acc is None or acc is x else x.add_(acc)


def shared_out(
    act: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, mlp: Fused, down: Fused
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A dense MLP's or shared expert's output ``down(act(gate(h)) * up(h))`` and Qwen's gate logit (None without
    one), not yet added."""
    # split_with_sizes: Tensor.split's Python wrapper costs a tenth of a decode layer's MoE half (measured-choices)
    gate, up, *gated = apply_linear(h, mlp).split_with_sizes(mlp.sizes, dim=-1)
    return apply_linear(act(gate) * up, down), (gated[0] if gated else None)


def add_mlp(x: torch.Tensor, h: torch.Tensor, mlp: Fused, down: Fused, act) -> torch.Tensor:
    """``x += mlp(h)`` in place: a dense layer's MLP."""
    z, gate = shared_out(act, h, mlp, down)
    assert gate is None  # a gate row belongs to a MoE layer's shared expert
    return x.add_(z)


class ExpertInput:
    """A layer's expert input rows, which of them are decode tokens (``decode``: all, none, or a bool mask [N]), and
    their bf16 copy, made once at the layer's first int4 expert on torch's kernel (``takes_bf16``) to need it."""

    def __init__(self, h: torch.Tensor, decode: bool | torch.Tensor):
        self.h = h
        self.decode = decode
        self._bf16: torch.Tensor | None = None

    def bf16(self) -> torch.Tensor:
        if self._bf16 is None:
            self._bf16 = self.h.to(torch.bfloat16)
        return self._bf16


def expert_rows(expert: Any, rows: ExpertInput, part: slice | None = None) -> torch.Tensor:
    """One routed expert on the input rows (``part`` of them) → its output rows: decode rows of an int4 expert on
    torch's kernel in bf16 (from the one bf16 copy), every other row in the activations' dtype (module docstring)."""
    h = rows.h if part is None else rows.h[part]
    if not getattr(expert, "takes_bf16", False) or rows.decode is False:
        return expert(h)
    hb = rows.bf16() if part is None else rows.bf16()[part]
    if rows.decode is True:
        return expert.forward_bf16(hb)
    decode = rows.decode if part is None else rows.decode[part]  # a prompt chunk beside decode tokens
    y = expert(h)
    if bool(decode.any()):
        y[decode] = expert.forward_bf16(hb[decode]).to(y.dtype)
    return y
