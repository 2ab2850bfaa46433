"""onnxruntime MatMulNBits as a 4-bit kernel: the hand-written graph, its numbers, and the measured choice."""

import onnx
import pytest
import torch
from fate_edge.quant import QuantSpec
from fate_edge.quant import linear as qlinear
from fate_edge.quant.linear import KERNEL_CHOICES, KERNEL_TIMINGS, QuantizedLinear, choose_kernel, pick_fastest
from fate_edge.quant.ort import OrtMatMul, int_zero_quantize, matmulnbits_model

SPEC = QuantSpec(4, 64)


def weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_graph_bytes_are_a_valid_onnx_model():
    codes, scale, zp = int_zero_quantize(weight(64, 192), SPEC)
    model = onnx.load_from_string(matmulnbits_model(codes, scale, zp, SPEC.group_size))
    onnx.checker.check_model(model)
    (node,) = model.graph.node
    assert (node.op_type, node.domain) == ("MatMulNBits", "com.microsoft")
    assert {a.name: a.i for a in node.attribute} == {
        "K": 192,
        "N": 64,
        "bits": 4,
        "block_size": 64,
        "accuracy_level": 4,
    }


@pytest.mark.parametrize("shape", [(64, 192), (192, 128), (48, 320)])  # 320/64 = 5 blocks: odd zero-point count
def test_ort_kernel_computes_its_dequantized_weights(shape):
    """fp32 compute (accuracy_level 0) isolates the layout: the output is x @ ((codes - zp) * scale).T."""
    w = weight(*shape)
    codes, scale, zp = int_zero_quantize(w, SPEC)
    g = SPEC.group_size
    w_hat = ((codes.float().view(shape[0], -1, g) - zp.float()[..., None]) * scale[..., None]).view(shape)
    assert (w_hat - w).abs().max() <= scale.max() / 2 + 1e-6  # a real 4-bit grid around w
    x = torch.randn(3, shape[1], generator=torch.Generator().manual_seed(1))
    y = OrtMatMul(w, SPEC, threads=1, accuracy_level=0)(x)
    ref = x @ w_hat.T
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_ort_kernel_in_quantized_linear_tracks_the_float_matmul():
    w = weight(256, 192)
    x = torch.randn(4, 192, generator=torch.Generator().manual_seed(2))
    lin = QuantizedLinear.from_float(w, SPEC, kernel="ort-int4")
    ref = x @ w.T
    assert lin.kernel == "ort-int4" and lin(x).dtype == torch.float32
    assert (lin(x) - ref).norm() / ref.norm() < 0.1  # 4-bit weights and int8 activations
    assert lin.nbytes == 2 * (256 * 192 // 2 + 5 * 256 * 3)  # the session keeps a prepacked copy too
    assert KERNEL_CHOICES[(4, (256, 192), "cpu")] == "ort-int4"


def test_kernel_is_timed_once_per_shape_and_the_fastest_is_kept(monkeypatch):
    w = weight(128, 192, seed=3)
    key = (4, (128, 192), "cpu", torch.get_num_threads())
    KERNEL_TIMINGS.pop(key, None)
    built = []
    real = QuantizedLinear.from_float.__func__

    def counting(cls, w, spec, device="cpu", kernel=None):
        built.append(kernel)
        return real(cls, w, spec, device, kernel)

    monkeypatch.setattr(qlinear.QuantizedLinear, "from_float", classmethod(counting))
    first = choose_kernel(w, SPEC, torch.device("cpu"))
    timed = list(built)
    assert choose_kernel(w, SPEC, torch.device("cpu")) == first and built == timed  # cached: nothing rebuilt
    assert sorted(timed) == ["ort-int4", "torch-int4"]
    assert first == pick_fastest(KERNEL_TIMINGS[key])


def test_a_kernel_must_beat_the_default_by_a_margin():
    assert pick_fastest({"torch-int4": 10.0, "ort-int4": 9.5}) == "torch-int4"  # within noise: keep the default
    assert pick_fastest({"torch-int4": 10.0, "ort-int4": 8.0}) == "ort-int4"
    assert pick_fastest({"torch-int4": 8.0, "ort-int4": 10.0}) == "torch-int4"
