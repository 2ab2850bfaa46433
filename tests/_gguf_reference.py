"""A store converted from a Hugging Face checkpoint with llama.cpp's q4_0 / q8_0 rounding (ggml's reference
quantizers, in torch), through the same store writer as ``convert``: what a GGUF of the same weights quantized the
same way must convert to."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from fate_edge.quant import Quantized

from fate_edge.format.checkpoint import CheckpointReader
from fate_edge.format.checkpoint_experts import ExpertLayout
from fate_edge.format.checkpoint_layout import layer_names
from fate_edge.format.checksum import crc32
from fate_edge.format.convert import AUX_FILES, ConvertOptions, StoreSource, _precisions, write_store
from fate_edge.format.store import MATRICES, encode_expert
from fate_edge.model.arch import load_config
from fate_edge.model.experts import ExpertWeights


def q4_0(w: torch.Tensor) -> Quantized:
    """ggml's quantize_row_q4_0_ref: d = (the signed value of largest magnitude) / -8, q = trunc(x / d + 8.5)."""
    rows, k = w.shape
    b = w.float().reshape(rows, k // 32, 32)
    big = b.gather(-1, b.abs().argmax(-1, keepdim=True))
    d = big / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc(b * inv + 8.5).clamp(0, 15).to(torch.uint8)
    dh = d[..., 0].to(torch.float16)
    return Quantized(q.reshape(rows, k), dh, dh * -8)


def q8_0(w: torch.Tensor) -> Quantized:
    """ggml's quantize_row_q8_0_ref: d = max|x| / 127, q = round-half-away(x / d)."""
    rows, k = w.shape
    b = w.float().reshape(rows, k // 32, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    x = b * inv
    q = torch.sign(x) * torch.floor(x.abs() + 0.5)
    dh = d[..., 0].to(torch.float16)
    return Quantized((q + 128).to(torch.uint8).reshape(rows, k), dh, dh * -128)


def reference_store(model_dir: Path, out: Path, kind: str, keep_bf16: bool = False) -> Path:
    quantize = {"q4_0": q4_0, "q8_0": q8_0}[kind]
    cfg = load_config(model_dir)
    reader = CheckpointReader(model_dir)
    names = layer_names(cfg, reader)
    layouts = {layer: ExpertLayout(reader, names[layer].mlp) for layer in cfg.moe_layers}
    opts = ConvertOptions.full(bits=8 if kind == "q8_0" else 4, group_size=32, keep_bf16=keep_bf16, layout="portable")
    precisions = _precisions(cfg, opts)

    def encode(layer, e, precs, method):
        w = layouts[layer].read(e, torch.float32)
        mats = [quantize(getattr(w, m)) for m in MATRICES]
        return [(b, crc32(b)) for b in (encode_expert(ExpertWeights(*mats), p, method) for p in precs)]

    def write_aux(tmp: Path) -> None:
        for f in AUX_FILES:
            if (model_dir / f).exists():
                shutil.copy2(model_dir / f, tmp / f)

    return write_store(
        StoreSource(model_dir, cfg, reader, names, 0, encode, write_aux, 0), out, opts, precisions, progress=False
    )
