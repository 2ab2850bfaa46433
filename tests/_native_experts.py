"""Shared by the grouped- and fused-expert tests: a random SiLU-gated int4 expert on the native kernel, and a few
greedy decode steps of a model whose logits those tests compare."""

from __future__ import annotations

from collections.abc import Callable

import torch
from fate_edge.quant import QuantSpec
from fate_edge.quant.linear import QuantizedLinear

from fate_edge.model.experts import QuantizedExpert

SPEC = QuantSpec(4, 64)


def native_expert(seed: int, hidden: int = 256, inter: int = 128, fused: bool = True) -> QuantizedExpert:
    """gate, up [inter, hidden] and down [hidden, inter] from ``seed``, int4 on the native kernel (gate and up in one
    matrix where ``fused``)."""
    g = torch.Generator().manual_seed(seed)
    mats = [torch.randn(inter, hidden, generator=g), torch.randn(inter, hidden, generator=g)]
    mats.append(torch.randn(hidden, inter, generator=g))
    expert = QuantizedExpert(*[QuantizedLinear.from_float(w, SPEC, kernel="native-int4") for w in mats])
    return expert.fused() if fused else expert


def decode_steps(model, steps: int = 3, after_prompt: Callable[[], None] = lambda: None) -> list[torch.Tensor]:
    """A fixed 5-token prompt, ``after_prompt()``, then ``steps`` greedy decode tokens → their logits."""
    cache = model.new_cache()
    with torch.inference_mode():
        tok = model(torch.tensor([[3, 17, 99, 5, 250]]), cache)[0, -1].argmax().view(1, 1)
        after_prompt()
        out = []
        for _ in range(steps):
            logits = model(tok, cache)
            out.append(logits)
            tok = logits[0, -1].argmax().view(1, 1)
    return out
