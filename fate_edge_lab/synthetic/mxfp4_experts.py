"""gpt-oss's experts as OpenAI publishes them: MXFP4 (``synth --mxfp4``).

The published gpt-oss checkpoints (openai/gpt-oss-20b, -120b) hold each expert matrix as ``<name>_blocks`` uint8
[E, out, in/32, 16] (E2M1 codes, two a byte, low nibble first) and ``<name>_scales`` uint8 [E, out, in/32] (E8M0),
rows in the [out, in] order where the float layout is [E, in, out], with a ``quantization_config`` naming the
modules left in bf16. The synthetic float weights (rounded to bf16, as the float layout stores them) are encoded
with llama.cpp's scheme (``quant.mxfp4.quantize_mxfp4``) one expert at a time: memory holds one expert's matrix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from fate_edge.quant.mxfp4 import BLOCK, quantize_mxfp4

from fate_edge_lab.synthetic.tensor_spec import TensorSpec

# openai/gpt-oss-20b's config.json: what transformers reads to dequantize (or run) the experts
QUANTIZATION_CONFIG: dict[str, Any] = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}
MATRICES = ("experts.gate_up_proj", "experts.down_proj")
ROWS_PER_ENCODE = 256  # rows quantized at once (the encoder holds 16 floats a weight)


@dataclass(frozen=True)
class PackedSpec:
    """One of the two uint8 tensors of an MXFP4 expert matrix (``part``: blocks or scales) of ``source``."""

    name: str
    shape: tuple[int, ...]
    source: TensorSpec
    part: str
    st_dtype: str = "U8"  # safetensors dtype (the writer's per-tensor override)


def is_expert_matrix(spec: TensorSpec) -> bool:
    return spec.kind == "expert" and spec.out_last and spec.name.endswith(MATRICES)


def mxfp4_specs(specs: list[TensorSpec]) -> list[TensorSpec | PackedSpec]:
    """``specs`` with each gpt-oss expert matrix [E, in, out] replaced by its blocks then its scales."""
    out: list[TensorSpec | PackedSpec] = []
    for s in specs:
        if not is_expert_matrix(s):
            out.append(s)
            continue
        e, k, n = s.shape
        if k % BLOCK:
            raise ValueError(
                f"--mxfp4: {s.name} has {k} inputs a row, not a multiple of MXFP4's {BLOCK}-weight blocks; "
                "pick a --scale that keeps hidden_size and intermediate_size multiples of 32 (1 or 2 for gpt-oss-20b)"
            )
        out.append(PackedSpec(f"{s.name}_blocks", (e, n, k // BLOCK, BLOCK // 2), s, "blocks"))
        out.append(PackedSpec(f"{s.name}_scales", (e, n, k // BLOCK), s, "scales"))
    return out


class Mxfp4Blocks:
    """The writer's ``blocks`` callable for :func:`mxfp4_specs`' entries: float tensors from ``float_blocks``, an
    expert matrix's codes one expert at a time (its scales kept until their entry, written right after)."""

    def __init__(self, float_blocks: Callable[[TensorSpec], Iterator[torch.Tensor]]):
        self.float_blocks = float_blocks
        self._scales: dict[str, list[torch.Tensor]] = {}

    def __call__(self, entry: TensorSpec | PackedSpec) -> Iterator[torch.Tensor]:
        if isinstance(entry, TensorSpec):
            yield from self.float_blocks(entry)
        elif entry.part == "scales":
            yield from self._scales.pop(entry.source.name)
        else:
            yield from self._codes(entry.source)

    def _codes(self, spec: TensorSpec) -> Iterator[torch.Tensor]:
        _, k, n = spec.shape
        scales = self._scales.setdefault(spec.name, [])
        pending: list[torch.Tensor] = []
        have = 0
        for block in self.float_blocks(spec):  # rows of [E * in, out], in order
            pending.append(block)
            have += block.shape[0]
            while have >= k:  # one expert's [in, out] matrix complete
                rows = torch.cat(pending)
                w, rest = rows[:k], rows[k:]
                pending, have = ([rest] if rest.shape[0] else []), rest.shape[0]
                wt = w.to(torch.bfloat16).float().t().contiguous()  # [out, in]: the values the float layout holds
                for r in range(0, n, ROWS_PER_ENCODE):
                    codes, sc = quantize_mxfp4(wt[r : r + ROWS_PER_ENCODE])
                    scales.append(sc)
                    yield codes
        if have:
            raise RuntimeError(f"{spec.name}: {have} rows left over, not a whole expert")
