"""A missed expert computed on the CPU where the host tier holds it, its output sent back (policy
``miss_compute="hybrid"``; planning.miss_placement chose it from the measured link and CPU speeds).

llama.cpp's ``--cpu-moe``, Fiddler and KTransformers serve a miss so: the token's hidden state crosses the link (a
few KB) instead of the expert (MBs). The expert is decoded on the CPU from its host-tier slot and called through
the same entry points as every expert (``layer_step.expert_rows``: a decode row of an int4 expert in bf16 from the
layer's one bf16 copy, other rows in the activations' dtype), so its output is what the device would compute from
the same codes up to the two kernels' rounding, and the MoE block adds it in expert-id order like every other.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


class OnHost:
    """``expert`` (decoded on the CPU) called with rows that live on another device: rows in, output back.
    ``timed(seconds, rows)``: told the CPU's compute time of each call (runtime.miss_rule measures it so)."""

    def __init__(self, expert: Any, timed: Callable[[float, int], None] | None = None):
        self.expert = expert
        self.takes_bf16 = bool(getattr(expert, "takes_bf16", False))
        self.timed = timed

    @property
    def nbytes(self) -> int:
        return int(self.expert.nbytes)

    def _run(self, f: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        rows = h.to("cpu")
        t0 = time.perf_counter()
        out = f(rows)
        if self.timed is not None:
            self.timed(time.perf_counter() - t0, rows.shape[0])
        return out.to(h.device)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return self._run(self.expert, h)

    def forward_bf16(self, hb: torch.Tensor) -> torch.Tensor:
        return self._run(self.expert.forward_bf16, hb)
