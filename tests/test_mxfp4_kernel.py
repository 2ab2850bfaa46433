"""MXFP4 experts computed on their blocks (``quant.mxfp4``): exact decoding (against transformers' own dequantizer and
llama.cpp's block layout), and the native kernel agreeing with dequantize-then-matmul in fp32 on both its paths."""

from __future__ import annotations

import pytest
import torch
from fate_edge.quant.mxfp4 import (
    MXFP4,
    Mxfp4Linear,
    check_mxfp4,
    dequantize_mxfp4,
    from_ggml,
    native_mxfp4_isa,
    native_mxfp4_status,
    quantize_mxfp4,
)


def _mxfp4(n: int, k: int, seed: int, lo: int = 118, hi: int = 136) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    return blocks, torch.randint(lo, hi, (n, k // 32), dtype=torch.uint8, generator=g)


def test_dequantize_matches_transformers_and_is_exact_in_bf16():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _mxfp4(3 * 40, 64, 0, 1, 255)  # every exponent but NaN, subnormal 2^-127 included
    blocks[0, 0], scales[0, 0] = 0x81, 0
    hf = convert_moe_packed_tensors(blocks.view(3, 40, 2, 16), scales.view(3, 40, 2), dtype=torch.float32)
    ours = dequantize_mxfp4(blocks, scales).view(3, 40, 64)
    finite = ours.isfinite()  # 6 * 2^127 overflows fp32 in both
    assert torch.equal(hf.transpose(1, 2)[finite], ours[finite]) and torch.equal(~finite, hf.transpose(1, 2).isinf())
    assert ours[0, 0, :2].tolist() == [0.5 * 2.0**-127, -0.0]  # low nibble first; -0 kept
    bf = dequantize_mxfp4(blocks, scales, torch.bfloat16).view(3, 40, 64)
    assert torch.equal(bf.float()[finite], ours[finite])


def test_quantize_round_trips_weights_on_the_grid():
    blocks, scales = _mxfp4(16, 128, 1)
    w = dequantize_mxfp4(blocks, scales)
    b2, s2 = quantize_mxfp4(w)
    assert torch.equal(dequantize_mxfp4(b2, s2), w)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    err = (dequantize_mxfp4(*quantize_mxfp4(x)) - x).abs()
    assert float(err.max()) <= 0.25 * float(x.abs().max())  # a half step of the top binade at most, E2M1's grid


def test_from_ggml_reads_llama_cpp_blocks_exactly():
    gguf_quants = pytest.importorskip("gguf.quants")
    import numpy as np

    w = torch.randn(6, 96, generator=torch.Generator().manual_seed(3))
    raw = gguf_quants.quantize(w.numpy(), gguf_quants.GGMLQuantizationType.MXFP4)  # llama.cpp's own encoder
    want = gguf_quants.dequantize(raw, gguf_quants.GGMLQuantizationType.MXFP4)
    blocks, scales = from_ggml(torch.from_numpy(np.ascontiguousarray(raw)))
    assert torch.equal(dequantize_mxfp4(blocks, scales), torch.from_numpy(want))
    ours = quantize_mxfp4(w)
    assert torch.equal(ours[0], blocks) and torch.equal(ours[1], scales)  # our encoder gives llama.cpp's codes


def test_native_kernel_builds_here():
    ok, why = native_mxfp4_status()
    assert ok, why
    assert native_mxfp4_isa() >= 1  # development and CI hosts have AVX2


@pytest.mark.parametrize("isa", [3, 2, 1, 0])
@pytest.mark.parametrize(
    ("n", "k", "m"),
    [(48, 384, 1), (33, 96, 1), (64, 2048, 1), (40, 160, 2), (17, 32, 3), (96, 512, 9), (23, 224, 4), (31, 64, 5)],
)
def test_native_kernel_matches_dequantize_then_matmul(isa, n, k, m):
    if native_mxfp4_isa() < isa:
        pytest.skip(f"this CPU does not run the kernel's path {isa}")
    blocks, scales = _mxfp4(n, k, n * k + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    ref = x @ dequantize_mxfp4(blocks, scales).T
    lin = Mxfp4Linear(blocks, scales)
    assert lin.kernel == "native-mxfp4" and lin.shape == (n, k) and lin.spec == MXFP4
    y = lin(x, isa=isa)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert float((y - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    dq = Mxfp4Linear(blocks, scales, "dequant")(x)
    assert float((dq - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


@pytest.mark.parametrize("isa", [3, 2, 1, 0])
def test_native_kernel_bf16_rows_and_leading_dims(isa):
    if native_mxfp4_isa() < isa:
        pytest.skip(f"this CPU does not run the kernel's path {isa}")
    blocks, scales = _mxfp4(32, 256, 7)
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
    lin = Mxfp4Linear(blocks, scales)
    y = lin(x, isa=isa)
    ref = (x.float() @ dequantize_mxfp4(blocks, scales).T).bfloat16()  # fp32 sums, rounded once to bf16
    assert y.shape == (2, 3, 32) and y.dtype == torch.bfloat16
    assert float((y.float() - ref.float()).abs().max()) <= 2**-7 * float(ref.float().abs().max())
    assert lin(x[:0], isa=isa).shape == (0, 3, 32)


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16-rows", "fp32-rows-split"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
def test_bf16_path_sums_exact_products(m, bf16):
    """On the AVX-512 BF16 path each product of a code and x is exact (a bf16 x as it is; an fp32 x split into three
    bf16 planes that sum to it) and summed in fp32: within fp32 summation error of the float64 dot product, as the
    fp32 path is. A lossy split (x rounded to bf16) would miss this bound by orders of magnitude."""
    if native_mxfp4_isa() < 3:
        pytest.skip("this CPU has no AVX-512 BF16")
    blocks, scales = _mxfp4(40, 1024, m)
    x = torch.randn(m, 1024, generator=torch.Generator().manual_seed(m))
    x = x.bfloat16() if bf16 else x
    w = dequantize_mxfp4(blocks, scales).double()
    exact = x.double() @ w.T
    bound = 1024 * 2**-24 * float((x.double().abs() @ w.abs().T).max())
    lin = Mxfp4Linear(blocks, scales)
    for isa in (3, 2):
        y = lin(x.float(), isa=isa)  # fp32 out: the sums themselves
        assert float((y.double() - exact).abs().max()) <= bound, isa
    assert float((lin(x.float().bfloat16().float(), isa=3).double() - exact).abs().max()) > bound or bf16


@pytest.mark.parametrize("isa", [3, 2])
@pytest.mark.parametrize("rows", [1, 2, 3, 5])  # the decode paths (one, two rows) and the row-buffered one
def test_nan_activation_gives_nan_rows_only(rows, isa):
    if native_mxfp4_isa() < isa:
        pytest.skip(f"this CPU does not run the kernel's path {isa}")
    blocks, scales = _mxfp4(16, 64, 9)
    x = torch.randn(rows, 64)
    x[rows - 1, 5] = float("nan")
    y = Mxfp4Linear(blocks, scales)(x, isa=isa)
    assert bool(y[rows - 1].isnan().all()) and bool(y[: rows - 1].isfinite().all())


def test_bad_blocks_and_scales_are_named():
    blocks, scales = _mxfp4(4, 64, 0)
    with pytest.raises(ValueError, match=r"^w\.down: MXFP4 blocks \[4, 32\] do not fit scales \[4, 3\]"):
        check_mxfp4("w.down", blocks, scales[:, :1].repeat(1, 3))
    with pytest.raises(ValueError, match=r"^w\.up: .*expected \[4, 96\]"):
        check_mxfp4("w.up", blocks, scales, (4, 96))
    bad = scales.clone()
    bad[2, 1] = 255
    with pytest.raises(ValueError, match=r"^w: an MXFP4 scale is 255"):
        check_mxfp4("w", blocks, bad)
    check_mxfp4("hf", blocks.view(4, 2, 16), scales, (4, 64))  # Hugging Face's [rows, groups, 16] form
