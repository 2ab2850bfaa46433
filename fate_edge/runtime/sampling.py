"""Token sampling: greedy, temperature, top-k, top-p, min-p and repetition penalty, seedable."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fate_edge.errors import GenerationError
from fate_edge.model import row_ops


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off; keep tokens with p >= min_p * p_max
    repetition_penalty: float = 1.0  # 1: off; CTRL-style, over prompt and generated tokens
    seed: int | None = None

    def validate(self) -> None:
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0 (0 is greedy), got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 disables it), got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p < 1, f"min_p must be in [0, 1), got {self.min_p}"),
            (
                self.repetition_penalty > 0,
                f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise GenerationError(message)


class Sampler:
    def __init__(self, params: SamplingParams):
        params.validate()
        self.params = params
        # Sampling draws on the CPU whatever the model's device: one seed gives the same stream on every device.
        self.generator = torch.Generator(device="cpu")
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, history: list[int]) -> int:
        """Pick the next token from ``logits`` [V] given the tokens so far."""
        p = self.params
        if p.temperature == 0 and p.repetition_penalty == 1.0:
            return greedy(logits)  # nothing to rescale, so no copy of the vocabulary's logits (but bf16 -> fp32)
        logits = logits.float().clone()
        if p.repetition_penalty != 1.0 and history:
            seen = torch.tensor(sorted(set(history)), dtype=torch.long, device=logits.device)
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if p.temperature == 0:
            return greedy(logits)
        logits = logits / p.temperature
        if p.top_k > 0 and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits[logits < kth] = float("-inf")
        probs = torch.softmax(logits, dim=-1)
        if p.min_p > 0:
            probs[probs < p.min_p * probs.max()] = 0
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_probs, dim=0)
            drop = cum - sorted_probs >= p.top_p  # keep the smallest prefix whose mass reaches top_p
            sorted_probs[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial((probs / probs.sum()).cpu(), 1, generator=self.generator))


def greedy(logits: torch.Tensor) -> int:
    """The first index of the largest logit (a NaN counts as largest), as ``torch.argmax``. On the CPU through
    numpy's vectorised argmax, an order of magnitude faster over a large vocabulary (docs/measured-choices.md); bf16
    logits through ``row_ops.argmax_bf16`` (a third of the float copy and numpy's argmax, measured)."""
    if logits.device.type != "cpu":
        return int(torch.argmax(logits))
    flat = logits.detach().reshape(-1)
    if flat.dtype == torch.bfloat16:  # fate-edge's kernel reads the bf16 logits as they are: no float copy
        best = row_ops.argmax_bf16(flat)
        if best is not None:
            return best
    return int((flat if flat.dtype == torch.float32 else flat.float()).numpy().argmax())
