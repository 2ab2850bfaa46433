"""How alike the MoE layers' gate inputs are across layers: per token, the cosine similarity of the input of layer
i's router and of the router ``distance`` MoE layers on, averaged over the held-out tokens.

The cross-layer predictor applies layer j's router to layer i's gate input, so it predicts as well as the two inputs
are alike; ``calibrate`` reports these numbers per model, which makes them comparable across architectures. On a
synthetic checkpoint (random weights) they are a property of the generator, not of the trained model.
"""

from __future__ import annotations

from typing import Any

import torch

_CHUNK = 1 << 15  # rows at a time: the float32 copies stay small beside a float16 trace of a million tokens


def gate_input_similarity(trace: Any, moe_layers: list[int], lookahead: int) -> list[dict[str, Any]]:
    """One row per MoE layer pair up to ``lookahead`` apart: ``source``, ``target``, ``distance``, the mean cosine
    and its 10th percentile over tokens. ``trace``: a ``predictors.evaluate.Trace`` (its ``gate_inputs``)."""
    out = []
    for d in range(1, lookahead + 1):
        for a, b in zip(moe_layers, moe_layers[d:], strict=False):
            x, y = trace.gate_inputs.get(a), trace.gate_inputs.get(b)
            if x is None or y is None or len(x) == 0:
                continue
            cos = torch.cat(
                [
                    torch.nn.functional.cosine_similarity(x[s : s + _CHUNK].float(), y[s : s + _CHUNK].float(), dim=-1)
                    for s in range(0, len(x), _CHUNK)
                ]
            )
            out.append(
                {
                    "source": a,
                    "target": b,
                    "distance": d,
                    "cosine": round(float(cos.mean()), 4),
                    "cosine_p10": round(float(torch.quantile(cos[: 1 << 24], 0.1)), 4),
                }
            )
    return out


def similarity_line(rows: list[dict[str, Any]]) -> str:
    """The rows as one Markdown line for calibrate's table (distance 1 only), or "" when there are none."""
    ones = [r for r in rows if r["distance"] == 1]
    if not ones:
        return ""
    pairs = ", ".join(f"{r['source']} → {r['target']}: {r['cosine']:.3f}" for r in ones)
    mean = sum(r["cosine"] for r in ones) / len(ones)
    return f"Gate-input cosine similarity, next MoE layer (held-out mean per token): {pairs}; mean {mean:.3f}."
