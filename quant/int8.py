"""Symmetric per-output-channel int8 weights and torch's int8 matmul (``_weight_int8pack_mm``, bf16 activations)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [N, K] → (codes int8 [N, K], scale bf16 [N]) with ``w ≈ codes * scale``."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12).to(torch.bfloat16)
    codes = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scale


@dataclass
class Int8Linear:
    """``y = x @ (codes * scale).T``; torch's int8 kernel on the CPU, dequantize-then-matmul elsewhere."""

    codes: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # bf16 [N]

    kernel = "torch-int8"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and hasattr(torch, "_weight_int8pack_mm"):
            xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
            y = torch._weight_int8pack_mm(xb.reshape(-1, x.shape[-1]), self.codes, self.scale)
            return y.view(*x.shape[:-1], -1).to(x.dtype)
        return F.linear(x, (self.codes.float() * self.scale.float()[:, None]).to(x.dtype))

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + 2 * self.scale.numel()
