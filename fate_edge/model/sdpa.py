"""Scaled dot-product attention with the backends that suit decode on every device.

On CUDA, torch may route bf16 attention to cuDNN's kernel, which builds an execution plan for every new shape: in
decode the key length grows by one each token, so every token paid a plan build
(docs/measured-choices.md). Flash attention (then memory-efficient, then math) needs no per-shape plan.

On the CPU, a decode query (one position, no mask) over a bf16 or fp16 cache goes to fate-edge's own kernel
(:mod:`fate_edge.model.decode_attention`: torch emulates bf16 GEMMs on CPUs without AVX512-BF16, several times
slower at real shapes); everything else keeps torch's own choice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fate_edge.model import decode_attention

_CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, **kw)``, without cuDNN's per-shape plans on CUDA and with bf16/fp16
    decode queries on the CPU in fate-edge's kernel."""
    if q.device.type != "cuda":
        if q.dtype in decode_attention.NATIVE_DTYPES and _plain(kw) and decode_attention.takes(q, k, v):
            scale = kw.get("scale")
            return decode_attention.attend(q, k, v, q.shape[-1] ** -0.5 if scale is None else scale)
        return F.scaled_dot_product_attention(q, k, v, **kw)
    with sdpa_kernel(_CUDA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, **kw)


def _plain(kw: dict) -> bool:
    """No mask, no causal flag, no dropout: every key attends (what a decode query over its own cache asks)."""
    return (
        kw.get("attn_mask") is None
        and not kw.get("is_causal", False)
        and not kw.get("dropout_p", 0.0)
        and set(kw) <= {"scale", "enable_gqa", "attn_mask", "is_causal", "dropout_p"}
    )
