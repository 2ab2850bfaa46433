"""Choosing how a weight matrix is quantized: ``rtn`` (round-to-nearest, Fate's scheme) or ``hqq``.

Both return a :class:`quant.rtn.Quantized` in the same convention (``w ≈ codes * scale + zero``,
fp16 scale and zero), so the choice only changes the codes and zeros written, never the format: a store
built with either is read by the same decoder and computed by the same kernels.
"""

from __future__ import annotations

import torch
from fate_edge.quant.hqq import quantize_hqq
from fate_edge.quant.rtn import Quantized, quantize
from fate_edge.quant.spec import QuantSpec

METHODS = ("rtn", "hqq")


def check_method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"unknown quantization method '{method}'; choose one of {', '.join(METHODS)}")
    return method


def quantize_with(method: str, w: torch.Tensor, spec: QuantSpec, work: torch.Tensor | None = None) -> Quantized:
    """Quantize ``w`` [..., K] group-wise with ``method`` ("rtn" or "hqq"); ``work``: RTN's fp32 scratch block."""
    if check_method(method) == "hqq":
        return quantize_hqq(w.float(), spec)
    return quantize(w, spec, work)
