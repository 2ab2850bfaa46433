"""The clairvoyant predictor: replays the experts a recorded run of the same request actually used.

It is the upper bound of prediction (the prefetch half of the ``oracle`` baseline in REFERENCES.md;
Belady's MIN, Belady 1966, is the eviction half: fate_edge/runtime/cache/belady.py). ``trace_calls`` lists every MoE
layer call of the recorded run in execution order as (layer, expert ids): [N, k] per token of the call
(what :class:`CallRecorder` keeps), or a flat list of the call's experts in priority order (one token's
top-k, or the union over a prefill's tokens, most used first, as the engine's trace records it).

A cursor follows the run: ``observe(layer, ...)`` moves it past the next call of ``layer``.
``predict(layer, h)`` returns the true experts of the next p calls that belong to this forward pass (the
targets of ``layer``): when a call has one row per row of ``h``, each row's own experts, one-hot and
normalised to sum 1; otherwise every row gets the call's experts weighted by how many of its routed
slots each took (count-based), ties kept in the recorded order.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

import torch
from fate_edge.predictors.base import Prediction, Predictor


class CallRecorder:
    """A routing observer (append to ``model.observers``) keeping (layer, expert ids [N, k]) per MoE call."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, list[list[int]]]] = []

    def __call__(self, layer: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        self.calls.append((layer, ids.tolist()))


class OraclePredictor(Predictor):
    def __init__(
        self,
        trace_calls: Sequence[tuple[int, Sequence]],
        moe_layers: list[int] | None = None,
        lookahead: int = 1,
        num_experts: int | None = None,
    ):
        """``moe_layers`` default to the layers seen in ``trace_calls``; ``num_experts`` (the width of the
        scores) to one more than the largest recorded id."""
        calls = []
        for layer, ids in trace_calls:
            t = torch.as_tensor(ids, dtype=torch.long)
            calls.append((int(layer), t.reshape(1, -1) if t.dim() == 1 else t))  # [N, k]
        super().__init__(moe_layers if moe_layers is not None else sorted({c[0] for c in calls}), lookahead)
        self.calls = calls
        seen = max((int(c[1].max()) + 1 for c in calls if c[1].numel()), default=1)
        self.num_experts = seen if num_experts is None else num_experts
        self.cursor = 0  # index of the next call not yet observed

    def reset(self) -> None:
        """Replay from the start (the recorded request is run again)."""
        self.cursor = 0

    def observe(self, layer: int, expert_ids: torch.Tensor | list | None = None) -> None:
        """``layer`` ran: move past its next call (calls in between are skipped, e.g. a layer not reported)."""
        for i in range(self.cursor, len(self.calls)):
            if self.calls[i][0] == layer:
                self.cursor = i + 1
                return
        self.cursor = len(self.calls)

    def targets(self, layer: int) -> tuple[int, ...]:
        """The next ``lookahead`` MoE layers, past the last one into the next token's pass: the recording knows
        its routing, so the bound reads the first layer's experts ahead as well (a resident layer cannot beat it)."""
        i = bisect_right(self.moe_layers, layer)
        order = self.moe_layers[i:] + self.moe_layers[:i]
        return tuple(order[: min(self.lookahead, len(order))])

    def upcoming(self, layer: int) -> list[tuple[int, torch.Tensor]]:
        """The recorded calls of ``self.targets(layer)`` that come next in this forward pass."""
        start = self.cursor
        if start < len(self.calls) and self.calls[start][0] == layer:  # predicted before observe(layer)
            start += 1
        out = []
        for target, call in zip(self.targets(layer), self.calls[start:]):
            if call[0] != target:  # the request ended or the run diverged
                break
            out.append(call)
        return out

    def predict(self, layer: int, h: torch.Tensor) -> Prediction:
        n = h.shape[0]
        calls = self.upcoming(layer)
        if not calls:
            return self.empty(n, self.num_experts)
        scores = torch.zeros(len(calls), n, self.num_experts)
        for p, (_, ids) in enumerate(calls):
            if ids.shape[0] == n:  # one row per token: each token's own experts
                scores[p].scatter_(1, ids, 1.0 / ids.shape[1])
            else:  # rows do not align: how many of the call's slots each expert took
                flat = ids.flatten()
                counts = torch.bincount(flat, minlength=self.num_experts).float()
                # Ties keep the recorded order: a bonus below one count, larger for earlier first appearance.
                first = torch.full((self.num_experts,), len(flat), dtype=torch.long)
                first.scatter_reduce_(0, flat, torch.arange(len(flat)), reduce="amin")
                counts += (counts > 0) * 0.5 * (1 - first.float() / len(flat))
                scores[p] = counts / counts.sum()
        return Prediction(tuple(c[0] for c in calls), scores)
