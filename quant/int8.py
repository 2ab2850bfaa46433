"""Symmetric per-output-channel int8 weights and torch's int8 matmul (``_weight_int8pack_mm``, bf16 activations)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BLOCK_BYTES = 16 << 20  # fp32 working set per block of rows
_ALIGN = 64  # bytes: torch's allocations are aligned to this, so a clone always is


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [N, K] → (codes int8 [N, K], scale bf16 [N]) with ``w ≈ codes * scale``.

    A block of rows at a time: a real lm_head (50k x 2k) in fp32 with its temporaries would otherwise hold
    several times the weight's own bytes at load, over the memory the deployment was sized for."""
    n, k = w.shape
    codes = torch.empty(n, k, dtype=torch.int8, device=w.device)
    scale = torch.empty(n, dtype=torch.bfloat16, device=w.device)
    step = max(1, BLOCK_BYTES // (4 * max(k, 1)))
    for r in range(0, n, step):
        b = w[r : r + step].float()
        s = (b.abs().amax(dim=1) / 127).clamp_min(1e-12).to(torch.bfloat16)
        codes[r : r + step] = b.div_(s.float()[:, None]).round_().clamp_(-127, 127)
        scale[r : r + step] = s
    return codes, scale


@dataclass
class Int8Linear:
    """``y = x @ (codes * scale).T``; torch's int8 kernel on the CPU, dequantize-then-matmul elsewhere."""

    codes: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # bf16 [N]

    kernel = "torch-int8"

    def __post_init__(self) -> None:
        # torch's CPU int8 kernel crashes (segfault) on codes that do not start on a 16-byte boundary, measured on
        # an AVX-512 Xeon (offsets 1-12 crash, 16 and 32 do not; AVX2 hosts did not); a store's memory-mapped
        # tensors start wherever safetensors put them. Such codes are copied once into an aligned allocation.
        if self.codes.device.type == "cpu" and self.codes.data_ptr() % _ALIGN:
            self.codes = self.codes.clone()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # torch's CPU int8 kernel segfaults when K is not a multiple of 16 (measured: 676-700 crash, 688 and 704
        # do not); such matrices (a scaled DeepSeek's dense down_proj, K = 684) dequantize instead
        if x.device.type == "cpu" and hasattr(torch, "_weight_int8pack_mm") and self.codes.shape[1] % 16 == 0:
            xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
            y = torch._weight_int8pack_mm(xb.reshape(-1, x.shape[-1]), self.codes, self.scale)
            return y.view(*x.shape[:-1], -1).to(x.dtype)
        return F.linear(x, (self.codes.float() * self.scale.float()[:, None]).to(x.dtype))

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + 2 * self.scale.numel()
