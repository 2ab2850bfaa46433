"""A store's int4 experts dequantized in float32 (fp16 scales as stored): the exact int4 model that grouped and
staged prefill are checked against."""

from __future__ import annotations

import torch
from fate_edge.quant.linear import QuantizedLinear

from fate_edge.format.store import ExpertStore
from fate_edge.model.experts import InMemoryExpertProvider, QuantizedExpert


def dequantized(path) -> InMemoryExpertProvider:
    """Every int4 expert of the store at ``path``, read from its blob and dequantized on the CPU in float32."""
    s = ExpertStore(path)
    prec = s.precisions[4]
    dt = {"codes": torch.uint8, "scale": getattr(torch, prec.scale_dtype), "zero": getattr(torch, prec.scale_dtype)}
    out = {}
    for layer in s.index["moe_layers"]:
        for e in range(s.index["num_experts"]):
            ref = s.ref(layer, e, 4)
            with open(ref.path, "rb") as f:
                f.seek(ref.offset)
                blob = torch.frombuffer(bytearray(f.read(ref.length)), dtype=torch.uint8)
            t = {
                p.name: blob[p.offset : p.offset + p.nbytes].view(dt[p.name.split(".")[1]]).view(p.shape)
                for p in prec.parts
            }
            mats = [
                QuantizedLinear.from_packed(
                    t[m + ".codes"], t[m + ".scale"], t.get(m + ".zero"), prec.spec, "cpu", "dequant"
                )
                for m in ("gate", "up", "down")
            ]
            out[(layer, e)] = QuantizedExpert(*mats)
    return InMemoryExpertProvider(out)
