"""Activation-path prediction, after MoE-Infinity (Xue et al. 2024, arXiv 2401.14361).

MoE-Infinity keeps, per request, an expert activation matrix (EAM): counts[layer, expert] of the tokens
this request has routed to each expert so far, and prefetches the experts of the coming layers in order
of those counts (the request's own activation path). It additionally matches the partial EAM against a
collection of EAMs from past requests to guess layers the request has not reached yet; this class is the
request-local part that REFERENCES.md's ``activation-path`` baseline specifies. It ignores the gate input
``h``: the prediction is the same for every token of a step.

``observe(layer, expert_ids)`` adds a routing decision, ``reset()`` starts a new request. Rows without
counts yet (and ties) are decided by global popularity (from calibration, if given; else uniform).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from fate_edge.predictors.base import Prediction, Predictor

_PRIOR_WEIGHT = 0.5  # < 1 count: global popularity only breaks ties, never overrides the request's counts


class ActivationPathPredictor(Predictor):
    def __init__(
        self,
        moe_layers: list[int],
        num_experts: int,
        lookahead: int = 1,
        popularity: dict[int, Sequence[float]] | None = None,
    ):
        """``popularity``: MoE layer → calibration count per expert (e.g. ``popularity.json``'s layers)."""
        super().__init__(moe_layers, lookahead)
        self.num_experts = num_experts
        self._position = {layer: m for m, layer in enumerate(self.moe_layers)}
        prior = torch.full((len(self.moe_layers), num_experts), 1.0 / num_experts)
        for layer, counts in (popularity or {}).items():
            if int(layer) in self._position:
                c = torch.as_tensor(counts, dtype=torch.float32)
                if c.sum() > 0:
                    prior[self._position[int(layer)]] = c / c.sum()
        self.prior = prior  # [M, E], rows sum to 1
        self.counts = torch.zeros(len(self.moe_layers), num_experts)  # [M, E] this request's EAM

    def reset(self) -> None:
        self.counts.zero_()

    def observe(self, layer: int, expert_ids: torch.Tensor | list) -> None:
        if layer not in self._position:
            return
        ids = torch.as_tensor(expert_ids, dtype=torch.long, device=self.counts.device).reshape(-1)
        self.counts[self._position[layer]] += torch.bincount(ids, minlength=self.num_experts).float()

    def predict(self, layer: int, h: torch.Tensor) -> Prediction:
        targets = self.targets(layer)
        n = h.shape[0]
        if not targets:
            return self.empty(n, self.num_experts)
        pos = [self._position[t] for t in targets]
        rows = self.counts[pos] + _PRIOR_WEIGHT * self.prior[pos]  # [P, E]
        rows = rows / rows.sum(-1, keepdim=True)
        return Prediction(targets, rows[:, None, :].expand(-1, n, -1).clone())
