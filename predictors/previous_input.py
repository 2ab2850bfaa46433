"""The previous token's next-layer gate input, a second input for the learned predictors.

Layer i's gate input h_i(t) decides most of layer i+1's routing; the rest is decided by layer i+1's attention
over the other tokens, which has not run when the prefetch must start. Part of it is already known: in decode
the previous token's forward pass is finished, and its layer i+1 gate input h_{i+1}(t-1) holds what that
attention saw one position earlier. A predictor reading [h_i(t), h_{i+1}(t-1)] stays causal and finds more of
layer i+1's experts, most on the first layer pair, where the gate input moves furthest
(``scripts/predictor_ceiling.py`` measures it; README "How well the calibrated predictors predict").

In the engine the previous row comes from state (:class:`PreviousInput`, fed every layer call by the
scheduler); on a recorded trace, whose rows are consecutive tokens of windows, it is the row above
(:func:`previous_rows`). A prompt's rows after its first have no previous row yet when a layer predicts (layer
i+1 has not run for them): they read zeros, as a window's first token does in training, and training zeroes
a share of rows (``TrainConfig.previous_dropout``) so zeros mean "unknown" rather than a rare input.
"""

from __future__ import annotations

import torch

from .base import next_moe_layers
from .evaluate import Trace


def previous_rows(x: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Row t holds row t-1 of the same window (zeros at a window's first position); rows are window-major,
    ``seq_len`` rows a window (the whole tensor is one window when ``seq_len`` is its length)."""
    w = x.reshape(-1, seq_len, x.shape[-1])
    out = torch.zeros_like(w)
    out[:, 1:] = w[:, :-1]
    return out.reshape(x.shape)


def widen_inputs(gate_inputs: dict[int, torch.Tensor], moe_layers: list[int], seq_len: int
                 ) -> dict[int, torch.Tensor]:
    """Every MoE layer that has a next one: its gate inputs [N, H] beside the next layer's, one row down [N, H]."""
    out = {}
    for i in moe_layers:
        nxt = next_moe_layers(moe_layers, i, 1)
        if nxt and i in gate_inputs and nxt[0] in gate_inputs:
            out[i] = torch.cat([gate_inputs[i].float(), previous_rows(gate_inputs[nxt[0]].float(), seq_len)], 1)
    return out


def widen_trace(trace: Trace, moe_layers: list[int], seq_len: int) -> Trace:
    """``trace`` with widened gate inputs (:func:`widen_inputs`): what a previous-input predictor reads."""
    return Trace(widen_inputs(trace.gate_inputs, moe_layers, seq_len), trace.expert_ids, trace.num_experts,
                 trace.token_ids)


class PreviousInput:
    """Per MoE layer, the gate input of the last token that passed it; widens a source layer's gate input."""

    def __init__(self, moe_layers: list[int]):
        self.moe_layers = sorted(moe_layers)
        self.last: dict[int, torch.Tensor] = {}  # MoE layer → [H], the latest token's gate input there

    def observe(self, layer: int, h: torch.Tensor) -> None:
        """``layer`` routed the rows of ``h`` [N, H]: its last row is the previous token's from now on."""
        self.last[layer] = h[-1].detach().float().clone()

    def reset(self) -> None:
        self.last.clear()

    def widen(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """[h, previous] [N, 2H]: the first row beside the next MoE layer's latest input, later rows beside zeros
        (a prompt's next rows have not reached that layer yet)."""
        h = h.float()
        prev = h.new_zeros(h.shape)
        nxt = next_moe_layers(self.moe_layers, layer, 1)
        if nxt and nxt[0] in self.last:
            prev[0] = self.last[nxt[0]]
        return torch.cat([h, prev], 1)


class ReadsPreviousInput:
    """Mixin for a predictor whose source models may read [h, previous] (``self.context`` set): keeps the state
    and widens a gate input that arrives alone; one already widened (a trace's, :func:`widen_trace`) passes."""

    context: PreviousInput | None = None
    hidden_size: int = 0  # the gate input's width, before widening

    def observe_input(self, layer: int, h: torch.Tensor) -> None:
        if self.context is not None:
            self.context.observe(layer, h)

    def reset(self) -> None:
        if self.context is not None:
            self.context.reset()

    def model_input(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        if self.context is not None and h.shape[-1] == self.hidden_size:
            return self.context.widen(layer, h)
        return h
