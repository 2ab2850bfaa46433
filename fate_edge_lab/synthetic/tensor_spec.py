"""One tensor of a synthetic checkpoint (name, shape, how to initialise it) and the MLP triple every family has."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the checkpoint and how to initialise it."""

    name: str
    shape: tuple[int, ...]
    role: str  # embed | lm_head | norm | bias | out_bias | score_bias | proj_in | attn_out | mlp_out | router | ...
    layer: int = -1  # decoder layer, -1 outside the layers
    kind: str = ""  # for mlp_out: dense | expert | shared
    out_last: bool = False  # stored [..., in, out] (gpt-oss's fused experts), not [out, in]
    offset: float = 0.0  # norms applied as offset + weight store the weight less this (Qwen3-Next)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _mlp(prefix: str, hidden: int, width: int, i: int, kind: str, names=("gate_proj", "up_proj", "down_proj")):
    gate, up, down = names
    return [
        TensorSpec(f"{prefix}.{gate}.weight", (width, hidden), "proj_in", i, kind),
        TensorSpec(f"{prefix}.{up}.weight", (width, hidden), "proj_in", i, kind),
        TensorSpec(f"{prefix}.{down}.weight", (hidden, width), "mlp_out", i, kind),
    ]
