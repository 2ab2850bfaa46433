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

from typing import Any

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


def widen_inputs(gate_inputs: dict[int, torch.Tensor], moe_layers: list[int], seq_len: int, previous: bool = True,
                 early: dict[int, torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
    """Every MoE layer that has a next one: what a learned predictor reads, [h_i, s_i, previous] with s_i the next
    layer's attention run early (``early``, early_attention.py) and previous the next layer's gate inputs one row
    down (``previous``); each part only when asked for."""
    out = {}
    for i in moe_layers:
        nxt = next_moe_layers(moe_layers, i, 1)
        if nxt and i in gate_inputs and nxt[0] in gate_inputs:
            parts = [gate_inputs[i].float()]
            if early is not None:
                parts.append(early[i].float())
            if previous:
                parts.append(previous_rows(gate_inputs[nxt[0]].float(), seq_len))
            out[i] = torch.cat(parts, 1)
    return out


def widen_trace(trace: Trace, moe_layers: list[int], seq_len: int, previous: bool = True, early: bool = False
                ) -> Trace:
    """``trace`` with widened gate inputs (:func:`widen_inputs`): what a previous-input and/or early-attention
    predictor reads (``early`` takes ``trace.early_inputs``: ``collect_traces(..., early=True)``)."""
    if early and trace.early_inputs is None:
        raise ValueError("the trace has no early-attention inputs: collect it with collect_traces(..., early=True)")
    wide = widen_inputs(trace.gate_inputs, moe_layers, seq_len, previous, trace.early_inputs if early else None)
    return Trace(wide, trace.expert_ids, trace.num_experts, trace.token_ids)


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

    def rows(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """The previous inputs [N, H] beside ``h``: the first row gets the next MoE layer's latest input, later
        rows zeros (a prompt's next rows have not reached that layer yet)."""
        prev = h.new_zeros(h.shape, dtype=torch.float32)
        nxt = next_moe_layers(self.moe_layers, layer, 1)
        if nxt and nxt[0] in self.last:
            prev[0] = self.last[nxt[0]]
        return prev

    def widen(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """[h, previous] [N, 2H] (:meth:`rows`)."""
        return torch.cat([h.float(), self.rows(layer, h)], 1)


class ReadsPreviousInput:
    """Mixin for a predictor whose source models may read more than the gate input h: the previous token's
    next-layer input (``self.context`` set) and/or the next layer's attention run early (``self.early_attention``;
    ``self.early`` once :meth:`attach` gave it the model). Keeps the state and widens a gate input that arrives
    alone to [h, early, previous]; one already widened (a trace's, :func:`widen_trace`) passes."""

    context: PreviousInput | None = None
    early_attention: bool = False
    early: Any = None  # early_attention.EarlyInput
    hidden_size: int = 0  # the gate input's width, before widening

    def attach(self, model: Any) -> None:
        """The engine's model, whose residual and KV cache the early attention reads (needed with early attention)."""
        if self.early_attention:
            from .early_attention import EarlyInput

            self.early = EarlyInput(model)

    def observe_input(self, layer: int, h: torch.Tensor) -> None:
        if self.context is not None:
            self.context.observe(layer, h)

    def reset(self) -> None:
        if self.context is not None:
            self.context.reset()

    def model_input(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        if h.shape[-1] != self.hidden_size or (self.context is None and not self.early_attention):
            return h
        parts = [h.float()]
        if self.early_attention:
            if self.early is None:
                raise RuntimeError("this predictor reads the next layer's attention run early: attach(model) first")
            parts.append(self.early.estimate(layer, h))
        if self.context is not None:
            parts.append(self.context.rows(layer, h))
        return torch.cat(parts, 1)
