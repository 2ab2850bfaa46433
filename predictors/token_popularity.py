"""Layer-0 expert prediction from the token id: a token → expert popularity table.

Nothing runs before the first MoE layer except the embedding, so the cross-layer gate has no input to
predict it from (Fate, WWW'26, arXiv 2502.12224, keeps layer 0 resident instead). But the first layer's
router reads little more than the token's own embedding, so which experts a token id was routed to in
calibration text predicts well which it will be routed to next time. Counts per (token, expert) come from
calibration traces; a token seen rarely is smoothed toward, and an unseen token falls back to, the
global expert popularity of that layer.

It predicts from :data:`~predictors.base.EMBEDDING` (source -1): ``predict(EMBEDDING, token_ids)`` or
:meth:`TokenPopularity.predict_from_tokens`. With lookahead p it covers the first p MoE layers.
"""

from __future__ import annotations

from pathlib import Path

import torch
from fate_edge.predictors.base import EMBEDDING, Prediction, Predictor
from fate_edge.predictors.evaluate import Trace


class TokenPopularity(Predictor):
    def __init__(self, counts: torch.Tensor, moe_layers: list[int], smoothing: float = 1.0):
        """``counts`` [P, V, E]: how often token v was routed to expert e in the p-th MoE layer.
        ``smoothing``: pseudo-count of the global popularity added to every token's row."""
        if counts.dim() != 3:
            raise ValueError(f"counts must be [P, V, E], got shape {tuple(counts.shape)}")
        super().__init__(moe_layers, counts.shape[0])
        if len(self.targets(EMBEDDING)) != counts.shape[0]:
            raise ValueError(f"counts cover {counts.shape[0]} layers, the model has {len(self.moe_layers)} MoE layers")
        self.counts = counts.float()
        self.smoothing = smoothing
        total = self.counts.sum(1)  # [P, E]
        # Global popularity of each target layer; uniform where the table is empty.
        self.prior = torch.where(
            total.sum(-1, keepdim=True) > 0,
            total / total.sum(-1, keepdim=True).clamp(min=1e-12),
            torch.full_like(total, 1.0 / total.shape[-1]),
        )  # [P, E]

    @classmethod
    def from_trace(cls, trace: Trace, vocab_size: int, lookahead: int = 1, smoothing: float = 1.0) -> TokenPopularity:
        """Count (token, expert) pairs of the first ``lookahead`` MoE layers of ``trace`` (needs its token ids)."""
        if trace.token_ids is None:
            raise ValueError("the trace has no token ids (record it with predictors.evaluate.collect_traces)")
        layers = trace.layers[:lookahead]
        counts = torch.zeros(len(layers), vocab_size, trace.num_experts)
        for p, layer in enumerate(layers):
            ids = trace.expert_ids[layer]  # [N, k]
            tok = trace.token_ids[:, None].expand_as(ids)
            counts[p].index_put_((tok.flatten(), ids.flatten()), torch.ones(ids.numel()), accumulate=True)
        return cls(counts, trace.layers, smoothing)

    @property
    def num_experts(self) -> int:
        return self.counts.shape[-1]

    def predict_from_tokens(self, token_ids: torch.Tensor | list[int]) -> Prediction:
        """Probabilities [P, N, E] for the first p MoE layers of tokens ``token_ids`` [N]."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        known = (ids >= 0) & (ids < self.counts.shape[1])
        rows = self.counts[:, ids.clamp(0, self.counts.shape[1] - 1)] * known[None, :, None]  # [P, N, E]
        rows = rows + self.smoothing * self.prior[:, None, :]
        seen = rows.sum(-1, keepdim=True)
        scores = torch.where(seen > 0, rows / seen.clamp(min=1e-12), self.prior[:, None, :].expand_as(rows))
        return Prediction(self.targets(EMBEDDING), scores)

    def predict(self, layer: int, h: torch.Tensor) -> Prediction:
        """From :data:`EMBEDDING`, ``h`` holds token ids [N]; from any later layer there is nothing to say."""
        if layer != EMBEDDING:
            return self.empty(h.shape[0], self.num_experts)
        if h.is_floating_point():
            raise TypeError("TokenPopularity predicts from token ids: pass an integer tensor [N] with EMBEDDING")
        return self.predict_from_tokens(h)

    def save(self, path: str | Path) -> Path:
        """One safetensors file: the counts, the MoE layers and the smoothing."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"moe_layers": ",".join(map(str, self.moe_layers)), "smoothing": repr(self.smoothing)}
        save_file({"counts": self.counts.contiguous()}, str(path), metadata=meta)
        return path

    @classmethod
    def load(cls, path: str | Path) -> TokenPopularity:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
            counts = f.get_tensor("counts")
        return cls(counts, [int(x) for x in meta["moe_layers"].split(",")], float(meta["smoothing"]))
