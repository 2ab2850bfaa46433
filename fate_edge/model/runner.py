"""How a one-token decode step runs: eagerly, compiled, or replayed as CUDA graphs, one runner chosen once.

Every runner runs the same layer function and the same attention (``attention.gqa``); they differ in what holds
the KV cache while a step runs (a growing cache, or static buffers a compiled or captured graph writes at a position
tensor) and in who launches the kernels. ``runner_choice.choose_runner`` picks the runner for a model as it is at its
first decode step (after an engine has attached its expert provider); ``MoETransformer.set_compile`` picks the
compiled one.
A compiled or captured runner that fails (a compiler error, an operation that cannot be captured, weights changed
under it) hands the model over to the eager runner for good, with the reason (:meth:`DecodeRunner.give_up`); a
token it cannot take as it stands (no prefill yet to copy into its buffers) it runs eagerly itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fate_edge.model import decode_step

if TYPE_CHECKING:
    import torch

    from fate_edge.model.decoding_model import DecodingModel
    from fate_edge.model.kv_cache import KVCache
    from fate_edge.model.layer import LayerPlan


class DecodeRunner:
    """The eager one-token step (:func:`decode_step.decode_token`): the runner a model decodes with unless a
    compiled or captured one is chosen, and the one those hand over to when they fail."""

    kind = "eager"

    def __init__(self, failed: str | None = None):
        self.failed = failed  # why a runner chosen before this one gave up (None: this one was chosen)

    def step(self, model: DecodingModel, token: torch.Tensor, cache: KVCache, plan: list[LayerPlan]) -> torch.Tensor:
        """``token`` [1, 1] continuing ``cache`` → logits [1, 1, V]."""
        return decode_step.decode_token(model, token, cache, plan)

    def give_up(self, model: DecodingModel, why: str) -> DecodeRunner:
        """Hand ``model`` over to the eager runner for good, ``why`` kept on both → the eager runner."""
        self.failed = why
        model.runner = eager = DecodeRunner(why)
        return eager
