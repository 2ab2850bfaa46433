"""onnxruntime's ``com.microsoft.MatMulNBits`` as a 4-bit matmul kernel for ``quant.linear``.

The one-node ONNX graph is written as protobuf bytes here (onnx, the package, is only a test dependency;
onnxruntime is a runtime one). Weights go in MatMulNBits' own layout: per row, ``K / block`` blocks of
``block / 2`` bytes, low nibble first; fp32 scales; 4-bit integer zero points, two per byte.
"""

from __future__ import annotations

import torch
from fate_edge.quant.spec import QuantSpec

_FLOAT, _UINT8 = 1, 2  # TensorProto.DataType
_INT = 2  # AttributeProto.AttributeType


def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(num: int, value: int | bytes | str) -> bytes:
    """One protobuf field: varint for ints, length-delimited for bytes/str/submessages."""
    if isinstance(value, int):
        return _varint(num << 3) + _varint(value)
    data = value.encode() if isinstance(value, str) else value
    return _varint(num << 3 | 2) + _varint(len(data)) + data


def _tensor(name: str, t: torch.Tensor, dtype: int) -> bytes:
    dims = b"".join(_field(1, d) for d in t.shape)
    return dims + _field(2, dtype) + _field(8, name) + _field(9, t.contiguous().numpy().tobytes())


def _value_info(name: str, dims: list[int | str]) -> bytes:
    shape = b"".join(_field(1, _field(1, d) if isinstance(d, int) else _field(2, d)) for d in dims)
    tensor_type = _field(1, _FLOAT) + _field(2, shape)
    return _field(1, name) + _field(2, _field(1, tensor_type))


def int_zero_quantize(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit RTN with *integer* zero points, the scheme MatMulNBits' fast kernels take.

    Returns (codes uint8 [N, K], scale fp32 [N, K/g], zero point uint8 [N, K/g]): ``w ≈ (codes - zp) * scale``.
    (Our stored codes have a float zero, ``codes * scale + zero``; with a float zero point onnxruntime falls
    back to a far slower kernel (docs/measured-choices.md), so this kernel quantizes from the float weights instead.)
    """
    n, k = w.shape
    g = w.float().reshape(n, k // spec.group_size, spec.group_size)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)  # the range holds 0, so zp fits 0..15
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    zp = torch.round(-lo / scale).clamp(0, 15)
    codes = torch.round(g / scale[..., None] + zp[..., None]).clamp(0, 15).to(torch.uint8).reshape(n, k)
    return codes, scale, zp.to(torch.uint8)


def matmulnbits_model(
    codes: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, block: int, accuracy_level: int = 4
) -> bytes:
    """ModelProto bytes computing ``Y = A @ W.T`` for ``W = (codes - zp) * scale`` [N, K] in 4 bits."""
    n, k = codes.shape
    c = codes.reshape(n, k // block, block)
    packed = c[..., 0::2] | (c[..., 1::2] << 4)  # [N, K/block, block/2], low nibble first
    kb = k // block
    zp_packed = torch.zeros(n, (kb + 1) // 2, dtype=torch.uint8)
    zp_packed[:, : (kb + 1) // 2] |= zp[:, 0::2]
    zp_packed[:, : kb // 2] |= zp[:, 1::2] << 4
    attrs = [("K", k), ("N", n), ("bits", 4), ("block_size", block), ("accuracy_level", accuracy_level)]
    node = b"".join(_field(1, i) for i in ("A", "B", "scales", "zero_points")) + _field(2, "Y")
    node += _field(4, "MatMulNBits") + _field(7, "com.microsoft")
    node += b"".join(_field(5, _field(1, a) + _field(3, v) + _field(20, _INT)) for a, v in attrs)
    graph = _field(1, node) + _field(2, "matmul")
    graph += _field(5, _tensor("B", packed, _UINT8))
    graph += _field(5, _tensor("scales", scale.float().reshape(-1), _FLOAT))
    graph += _field(5, _tensor("zero_points", zp_packed.reshape(-1), _UINT8))
    graph += _field(11, _value_info("A", ["M", k])) + _field(12, _value_info("Y", ["M", n]))
    opsets = _field(8, _field(1, "") + _field(2, 17)) + _field(8, _field(1, "com.microsoft") + _field(2, 1))
    return _field(1, 8) + opsets + _field(7, graph)


def ort_available() -> bool:
    """Whether onnxruntime is installed, without importing it (+29 MB resident once imported, measured): a process that
    never builds an ``OrtMatMul`` or an ONNX predictor never loads it."""
    import importlib.util

    return importlib.util.find_spec("onnxruntime") is not None


class OrtMatMul:
    """A callable ``x [M, K] -> x @ W.T [M, N]`` on one onnxruntime session, W in 4 bits (fp32 in and out)."""

    def __init__(self, w: torch.Tensor, spec: QuantSpec, threads: int | None = None, accuracy_level: int = 4):
        import onnxruntime as ort

        codes, scale, zp = int_zero_quantize(w, spec)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads or torch.get_num_threads()
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")  # no spinning between our ops
        model = matmulnbits_model(codes, scale, zp, spec.group_size, accuracy_level)
        self.session = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
        n, k = w.shape
        # codes, fp32 scales and 4-bit zero points, twice: the session keeps its initializers and the copy MLAS
        # prepacked from them (RSS per session measured at 1.7-1.9x the int4 bytes, session overhead apart)
        self.nbytes = 2 * (n * k // 2 + 5 * n * (k // spec.group_size))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.session.run(None, {"A": x.float().contiguous().numpy()})[0]
        return torch.from_numpy(y).to(x.dtype)
