"""The ``Predictor`` interface every expert predictor implements (training-free or learned)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from bisect import bisect_right
from dataclasses import dataclass

import torch

# Source "layer" of predictions made from token ids before layer 0 runs (see token_popularity.py):
# ``next_moe_layers(moe_layers, EMBEDDING, p)`` is the first p MoE layers.
EMBEDDING = -1


def next_moe_layers(moe_layers: list[int], layer: int, lookahead: int) -> tuple[int, ...]:
    """The first ``lookahead`` MoE layers after ``layer``: dense layers are skipped, not counted."""
    start = bisect_right(moe_layers, layer)
    return tuple(moe_layers[start : start + lookahead])


@dataclass
class Prediction:
    """Scores for the experts of the coming MoE layers; higher means more likely routed."""

    layers: tuple[int, ...]  # target MoE layers, nearest first
    scores: torch.Tensor  # [P, N, E], P = len(layers)

    def for_layer(self, layer: int) -> torch.Tensor:
        """Scores [N, E] for one target layer."""
        return self.scores[self.layers.index(layer)]

    def topk(self, k: int) -> torch.Tensor:
        """Expert ids [P, N, k], most likely first (k is clipped to the number of experts)."""
        return self.scores.topk(min(k, self.scores.shape[-1]), dim=-1).indices


class Predictor(ABC):
    """Given layer ``i`` and its gate input ``h`` [N, H] (the post-attention-norm output the router
    reads), score the experts of the next ``lookahead`` MoE layers.

    ``moe_layers`` lists the model's MoE layers in order; targets are always MoE layers, so a dense
    layer between i and its target is skipped rather than counted in the lookahead.
    """

    def __init__(self, moe_layers: list[int], lookahead: int = 1):
        if lookahead < 1:
            raise ValueError(f"lookahead must be >= 1, not {lookahead}")
        self.moe_layers = sorted(moe_layers)
        self.lookahead = lookahead

    def targets(self, layer: int) -> tuple[int, ...]:
        """The MoE layers a prediction from ``layer`` covers (empty after the last MoE layer)."""
        return next_moe_layers(self.moe_layers, layer, self.lookahead)

    def empty(self, n: int, num_experts: int, device: torch.device | str = "cpu") -> Prediction:
        """The prediction for a layer with nothing to predict (after the last MoE layer)."""
        return Prediction((), torch.zeros((0, n, num_experts), dtype=torch.float32, device=device))

    def to(self, device: torch.device | str) -> Predictor:  # noqa: B027 (optional hook)
        """Move any weights to ``device`` (the model's), so predicting makes no cross-device copy; returns self.
        Predictors without tensors, or that run elsewhere by design (onnxruntime on the CPU), keep theirs."""
        return self

    def top_row(self, layer: int, h: torch.Tensor, n: int) -> tuple[int, list[int]] | None:
        """One decode row's nearest target layer and its ``n`` most probable experts, most probable first, where
        this predictor has a path for it cheaper than :meth:`predict` (the same choice); None: use :meth:`predict`."""
        return None

    @abstractmethod
    def predict(self, layer: int, h: torch.Tensor) -> Prediction:
        """Scores for ``self.targets(layer)`` from gate inputs ``h`` [N, H] of ``layer``."""

    def observe(self, layer: int, expert_ids: torch.Tensor | list) -> None:  # noqa: B027 (optional hook)
        """The experts ``layer`` actually routed to (ids [N, k], or a list). Stateful predictors
        (activation path, oracle) learn from it; the default ignores it."""

    def observe_input(self, layer: int, h: torch.Tensor) -> None:  # noqa: B027 (optional hook)
        """``layer`` routed gate inputs ``h`` [N, H] (after it predicted, every layer call). Predictors that read
        the previous token's inputs (previous_input.py) keep them; the default ignores them."""

    def reset(self) -> None:  # noqa: B027 (optional hook)
        """A new request starts: forget per-request state. The default has none."""
