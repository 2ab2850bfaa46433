"""RMSNorm as the reference models compute it: transformers' Qwen2-MoE norm (float32, then scaled in the input's
dtype), bit for bit, in bf16 and float32 models, per token or per head, at one thread and two."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeRMSNorm

from fate_edge.model.layer import rms_norm


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 2048), (7, 2048), (1, 16, 128), (3, 192)], ids=str)
def test_rms_norm_has_the_reference_models_bits(threads, dtype, shape):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(sum(shape))
        ref = Qwen2MoeRMSNorm(shape[-1], eps=1e-6).to(dtype)
        with torch.no_grad():
            ref.weight.copy_(1 + 0.1 * torch.randn(shape[-1], generator=g))
        for scale in (1e-3, 1.0, 40.0):
            x = (torch.randn(shape, generator=g) * scale).to(dtype)
            with torch.no_grad():
                want = ref(x)
            assert torch.equal(rms_norm(x, ref.weight.detach(), 1e-6), want)
    finally:
        torch.set_num_threads(before)
