"""Quantization of routed experts: specs, group-wise round-to-nearest, bit packing.

Knows nothing about models, files or caches: tensors in, tensors out.
"""

from fate_edge.quant.pack import pack, packed_nbytes, unpack
from fate_edge.quant.rtn import PackedQuantized, Quantized, dequantize, quantize
from fate_edge.quant.spec import QuantSpec, bytes_per_weight, tensor_nbytes

__all__ = [
    "QuantSpec",
    "PackedQuantized",
    "Quantized",
    "bytes_per_weight",
    "dequantize",
    "pack",
    "packed_nbytes",
    "quantize",
    "tensor_nbytes",
    "unpack",
]
