"""The training-free cross-layer gate predictor of Fate (WWW'26, arXiv 2502.12224).

Layer i's gate input ``h_i`` (already normalised by layer i's post_attention_layernorm) is fed to the
router of the next MoE layer: ``softmax(W_gate[i+1] · h_i)``. It works because the residual stream
changes little from one layer to the next. Lookahead p > 1 stacks the next p routers into one
[p·E, H] matrix so all p layers are scored by one matmul (as HOBBIT, arXiv 2411.01433, does).

Norm variant: ``h_i = x · w_i / rms(x)`` while the target router reads ``x' · w_j / rms(x')``.
Assuming x' ≈ x, ``h_j ≈ h_i · w_j / w_i``: rescale elementwise by the ratio of the two layers'
post_attention_layernorm weights. The ratio is folded into the stacked gate matrix once per layer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from fate_edge.predictors.base import Prediction, Predictor

from fate_edge.model import native_router

_MIN_NORM = 1e-6  # keeps the norm ratio finite where a norm weight is (near) zero


class CrossLayerGate(Predictor):
    def __init__(
        self,
        gates: dict[int, torch.Tensor],
        lookahead: int = 1,
        norms: dict[int, torch.Tensor] | None = None,
        score: str = "softmax",
        score_bias: dict[int, torch.Tensor] | None = None,
        logit_bias: dict[int, torch.Tensor] | None = None,
    ):
        """``gates``: MoE layer → router weight [E, H]. ``norms``: layer → post_attention_layernorm weight
        [H] for every layer (enables the norm variant). ``score``: "softmax" (Mixtral, Qwen, OLMoE,
        DeepSeek-V2, ERNIE-4.5) or "sigmoid" (DeepSeek-V3, GLM-4.5, MiniMax-M2). ``score_bias``: the selection-only
        correction the router adds to the scores for ranking (DeepSeek-V3, GLM, MiniMax-M2, ERNIE).
        ``logit_bias``: MoE layer → the router's own bias [E] (gpt-oss), added to its logits."""
        super().__init__(list(gates), lookahead)
        if score not in ("softmax", "sigmoid"):
            raise ValueError(f"score must be 'softmax' or 'sigmoid', not {score!r}")
        self.score = score
        self.norms = norms
        self.stack = torch.stack([gates[i].float() for i in self.moe_layers])  # [M, E, H]
        self.num_experts = self.stack.shape[1]
        self.bias = None
        if score_bias:
            self.bias = torch.stack([score_bias[i].float() for i in self.moe_layers])  # [M, E]
        self.logit_bias = None
        if logit_bias:
            self.logit_bias = torch.stack([logit_bias[i].float() for i in self.moe_layers])  # [M, E]
        self._position = {layer: m for m, layer in enumerate(self.moe_layers)}
        self._scaled: dict[int, torch.Tensor] = {}  # norm variant: source layer → stacked [P·E, H]

    @classmethod
    def from_model(cls, model: Any, lookahead: int = 1, norm_variant: bool = False) -> CrossLayerGate:
        """Build from a loaded :class:`fate_edge.model.transformer.MoETransformer` (its resident routers and norms)."""
        cfg = model.config
        gates = {i: model.w[f"{model.names[i].router}.weight"] for i in cfg.moe_layers}
        biases = {i: model.w.get(f"{model.names[i].router}.bias") for i in cfg.moe_layers}
        logit_bias = biases if all(b is not None for b in biases.values()) else None
        norms = None
        if norm_variant:
            norms = {i: model.w[f"{n.post_attn_norm}.weight"] for i, n in enumerate(model.names)}
        from fate_edge.model.layer import _correction_bias  # the loader's lookup: router, block or moe_statics

        score = "sigmoid" if cfg.router == "deepseek_v3" else "softmax"
        found = {i: _correction_bias(model.w, model.names[i].mlp) for i in cfg.moe_layers}
        bias = {i: b for i, b in found.items() if b is not None}
        return cls(gates, lookahead, norms, score, bias if len(bias) == len(found) else None, logit_bias)

    def _matrix(self, layer: int, first: int, p: int) -> torch.Tensor:
        plain = self.stack[first : first + p]  # [P, E, H], a view: no copy for the plain predictor
        if self.norms is None:
            return plain.reshape(-1, plain.shape[-1])
        if layer not in self._scaled:
            src = self.norms[layer].float()
            src = torch.where(src.abs() < _MIN_NORM, torch.full_like(src, _MIN_NORM).copysign(src), src)
            ratio = torch.stack([self.norms[j].float() / src for j in self.moe_layers[first : first + p]])  # [P, H]
            self._scaled[layer] = (plain * ratio[:, None, :]).reshape(-1, plain.shape[-1])
        return self._scaled[layer]

    def stacked(self, layer: int) -> torch.Tensor:
        """The [P·E, H] matrix scoring ``self.targets(layer)`` from ``layer``'s gate input (nearest target's
        rows first); the learned predictors start from it."""
        targets = self.targets(layer)
        if not targets:
            return self.stack.new_zeros((0, self.stack.shape[-1]))
        return self._matrix(layer, self._position[targets[0]], len(targets))

    def top_row(self, layer: int, h: torch.Tensor, n: int) -> tuple[int, list[int]] | None:
        """:meth:`predict`'s ranking for one row of a softmax-scored model without biases, its nearest target only, in
        one native call (the router's kernel on the predictor's matrix, one thread) where it takes it: with the gate
        open the prediction runs every decode layer, and its operators from Python cost a good part of what a read
        ahead saves (docs/measured-choices.md). Its float32 sums are the kernel's: the ranking may differ from torch's
        where two scores differ in their last bits; None where the top n hold a tie or the kernel does not take it."""
        targets = self.targets(layer)
        if not targets or self.score != "softmax" or self.bias is not None or self.logit_bias is not None:
            return None
        w = self._matrix(layer, self._position[targets[0]], len(targets))[: self.num_experts]  # the nearest's rows
        hidden = w.shape[1]
        if h.shape != (1, hidden) or h.device.type != "cpu" or hidden % 8 or not 0 < n <= min(w.shape[0], 64):
            return None
        if h.dtype not in (torch.float32, torch.bfloat16) or w.dtype != torch.float32 or w.device.type != "cpu":
            return None
        if not w.is_contiguous():
            return None
        if not native_router.available()[0]:
            return None
        top = native_router.top_softmax(h, w, n)
        if top is None:
            return None
        return targets[0], top[1][0].tolist()

    def predict(self, layer: int, h: torch.Tensor) -> Prediction:
        targets = self.targets(layer)
        n, e = h.shape[0], self.num_experts
        if not targets:
            return Prediction((), h.new_zeros((0, n, e), dtype=torch.float32))
        first = self._position[targets[0]]
        w = self._matrix(layer, first, len(targets))
        logits = F.linear(h.to(w.dtype), w).view(n, len(targets), e).transpose(0, 1)  # [P, N, E]
        if self.logit_bias is not None:
            logits = logits + self.logit_bias[first : first + len(targets), None, :]
        scores = torch.softmax(logits, dim=-1) if self.score == "softmax" else torch.sigmoid(logits)
        if self.bias is not None:
            scores = scores + self.bias[first : first + len(targets), None, :]
        return Prediction(targets, scores)
