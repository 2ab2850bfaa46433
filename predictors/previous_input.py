"""The previous token's next-layer gate input, a second input for the learned predictors.

Layer i's gate input h_i(t) decides most of layer i+1's routing; the rest is decided by layer i+1's attention
over the other tokens, which has not run when the prefetch must start. Part of it is already known: in decode
the previous token's forward pass is finished, and its layer i+1 gate input h_{i+1}(t-1) holds what that
attention saw one position earlier. A predictor reading [h_i(t), h_{i+1}(t-1)] stays causal and finds more of
layer i+1's experts, most on the first layer pair, where the gate input moves furthest
(``research/predictor_ceiling.py`` measures it; docs/predictors.md).

In the engine the previous row comes from state (:class:`PreviousInput`, fed every layer call by the
scheduler); on a recorded trace, whose rows are consecutive tokens of windows, it is the row above
(:func:`previous_rows`). A prompt's rows after its first have no previous row yet when a layer predicts (layer
i+1 has not run for them): they read zeros, as a window's first token does in training, and training zeroes
a share of rows (``TrainConfig.previous_dropout``) so zeros mean "unknown" rather than a rare input.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from fate_edge.predictors.base import next_moe_layers
from fate_edge.predictors.evaluate import Trace


def previous_rows(x: torch.Tensor, seq_len: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """Rows ``start:stop`` of "the row above": row t holds row t-1 of the same window (zeros at a window's first
    position); rows are window-major, ``seq_len`` rows a window (the whole tensor is one window when ``seq_len``
    is its length). Only the asked rows are copied, so a slice of a long trace costs the slice."""
    t = torch.arange(start, x.shape[0] if stop is None else stop)
    out = x[(t - 1).clamp_min(0)]
    out[t % seq_len == 0] = 0
    return out


class WidenedInputs(Mapping[int, torch.Tensor]):
    """Per source MoE layer (one with a next MoE layer), what a learned predictor reads: [h_i, s_i, previous] in
    float32, with s_i the next layer's attention run early (``early``, early_attention.py) and previous the next
    layer's gate inputs one row down (``previous``); each part only when asked for.

    Built when a layer is read, from the trace's own tensors (which may be kept in half precision), and only for
    rows ``start:stop``: calibrating on millions of tokens holds the trace once, not every layer's widened
    float32 copy beside it (which at 1M tokens of an 8-layer, 192-wide model with both parts is 16 GB)."""

    def __init__(
        self,
        gate_inputs: Mapping[int, torch.Tensor],
        moe_layers: list[int],
        seq_len: int,
        previous: bool = True,
        early: Mapping[int, torch.Tensor] | None = None,
        start: int = 0,
        stop: int | None = None,
    ):
        self.gate_inputs, self.moe_layers, self.seq_len = gate_inputs, sorted(moe_layers), seq_len
        self.previous, self.early = previous, early
        total = next(iter(gate_inputs.values())).shape[0] if gate_inputs else 0
        self.start, self.stop = start, total if stop is None else stop
        self._next = {}
        for i in self.moe_layers:
            nxt = next_moe_layers(self.moe_layers, i, 1)
            if nxt and i in gate_inputs and nxt[0] in gate_inputs and (early is None or i in early):
                self._next[i] = nxt[0]

    def __getitem__(self, layer: int) -> torch.Tensor:
        if layer not in self._next:
            raise KeyError(layer)
        a, b = self.start, self.stop
        h = self.gate_inputs[layer][a:b]
        width = h.shape[1] * (1 + (self.early is not None) + self.previous)
        # Written part by part into one float32 block: no float32 copies of the parts beside the result.
        out = torch.empty(b - a, width, dtype=torch.float32)
        out[:, : h.shape[1]] = h
        col = h.shape[1]
        if self.early is not None:
            out[:, col : col + h.shape[1]] = self.early[layer][a:b]
            col += h.shape[1]
        if self.previous:
            out[:, col:] = previous_rows(self.gate_inputs[self._next[layer]], self.seq_len, a, b)
        return out

    def __contains__(self, layer: object) -> bool:
        return layer in self._next  # not Mapping's default, which would build the layer's inputs

    def __iter__(self) -> Iterator[int]:
        return iter(self._next)

    def __len__(self) -> int:
        return len(self._next)

    def rows(self, start: int, stop: int | None = None) -> WidenedInputs:
        """The same inputs for rows ``start:stop`` of these (Trace.rows)."""
        r = range(self.start, self.stop)[slice(start, stop)]
        return WidenedInputs(
            self.gate_inputs, self.moe_layers, self.seq_len, self.previous, self.early, r.start, r.stop
        )


def widen_inputs(
    gate_inputs: dict[int, torch.Tensor],
    moe_layers: list[int],
    seq_len: int,
    previous: bool = True,
    early: dict[int, torch.Tensor] | None = None,
) -> dict[int, torch.Tensor]:
    """Every MoE layer that has a next one: :class:`WidenedInputs`, built at once."""
    return dict(WidenedInputs(gate_inputs, moe_layers, seq_len, previous, early))


def widen_trace(trace: Trace, moe_layers: list[int], seq_len: int, previous: bool = True, early: bool = False) -> Trace:
    """``trace`` with widened gate inputs (:class:`WidenedInputs`, built per layer when read): what a
    previous-input and/or early-attention predictor reads (``early`` takes ``trace.early_inputs``:
    ``collect_traces(..., early=True)``)."""
    if early and trace.early_inputs is None:
        raise ValueError("the trace has no early-attention inputs: collect it with collect_traces(..., early=True)")
    wide = WidenedInputs(trace.gate_inputs, moe_layers, seq_len, previous, trace.early_inputs if early else None)
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

    if TYPE_CHECKING:  # the Predictor's, which every class using this mixin also derives from

        def to(self, device: Any) -> Any: ...

    def attach(self, model: Any) -> None:
        """The engine's model: the predictor moves to its device, and the early attention reads its residual and KV
        cache (needed with early attention)."""
        self.to(model.device)
        if self.early_attention:
            from fate_edge.predictors.early_attention import EarlyInput

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
