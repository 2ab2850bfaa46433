"""A missed expert computed on the CPU where the host tier holds it, its output sent back (policy
``miss_compute="hybrid"``; planning.miss_placement chose it from the measured link and CPU speeds).

llama.cpp's ``--cpu-moe``, Fiddler and KTransformers serve a miss so: the token's hidden state crosses the link (a
few KB) instead of the expert (MBs). The expert is decoded on the CPU from its host-tier slot and called through
the same entry points as every expert (``layer_step.expert_rows``: a decode row of an int4 expert in bf16 from the
layer's one bf16 copy, other rows in the activations' dtype), so its output is what the device would compute from
the same codes up to the two kernels' rounding, and the MoE block adds it in expert-id order like every other.
"""

from __future__ import annotations

from typing import Any

import torch


class OnHost:
    """``expert`` (decoded on the CPU) called with rows that live on another device: rows in, output back."""

    def __init__(self, expert: Any):
        self.expert = expert
        self.takes_bf16 = bool(getattr(expert, "takes_bf16", False))

    @property
    def nbytes(self) -> int:
        return int(self.expert.nbytes)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return self.expert(h.to("cpu")).to(h.device)

    def forward_bf16(self, hb: torch.Tensor) -> torch.Tensor:
        return self.expert.forward_bf16(hb.to("cpu")).to(hb.device)
