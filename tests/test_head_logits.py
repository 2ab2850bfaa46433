"""The output head on one decode row through fate-edge's matvec kernel (``layer.head_logits``)."""

from __future__ import annotations

import pytest
import torch

from fate_edge.model import head_matvec, layer
from fate_edge.model.layer import Fused, head_logits


def _head(rows: int, cols: int, dtype: torch.dtype) -> Fused:
    torch.manual_seed(0)
    return Fused(torch.randn(rows, cols).to(dtype), None, [rows])


def _refuse(*args, **kwargs):
    raise AssertionError("this path must not run")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_row_goes_through_the_kernel_within_one_rounding_of_the_exact_product(monkeypatch, dtype):
    head = _head(1003 * 8, 2880, dtype)  # gpt-oss's hidden width; rows not a multiple of the kernel's blocks
    x = torch.randn(1, 2880).to(dtype)
    monkeypatch.setattr(layer, "apply_linear", _refuse)  # the kernel, not torch, computes it
    got = head_logits(x, head)
    assert got.shape == (1, head.weight.shape[0]) and got.dtype == dtype
    exact = x.double() @ head.weight.double().t()
    ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)  # one unit in the last place, relative
    assert ((got.double() - exact).abs() <= exact.abs() * ulp + 1e-3).all()


def test_several_rows_and_float32_heads_stay_on_torch(monkeypatch):
    monkeypatch.setattr(head_matvec, "w_x", _refuse)
    head = _head(512, 64, torch.bfloat16)
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert torch.equal(head_logits(x, head), torch.nn.functional.linear(x, head.weight))
    f32 = _head(512, 64, torch.float32)
    one = torch.randn(1, 64)
    assert torch.equal(head_logits(one, f32), torch.nn.functional.linear(one, f32.weight))


def test_a_row_alone_has_the_bits_it_has_beside_others_in_the_kernel():
    head = _head(4096, 256, torch.bfloat16)
    x = torch.randn(4, 256).to(torch.bfloat16)
    alone = torch.cat([head_logits(x[i : i + 1], head) for i in range(4)])
    together = head_matvec.w_x(x[:, None, :], head.weight[None]).view(4, -1).to(torch.bfloat16)
    assert torch.equal(alone, together)
