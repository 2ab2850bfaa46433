"""``fate-edge convert MODEL.gguf STORE``: a GGUF file → an expert store, as ``convert`` does for a model directory.

The config and tokenizer come from the file's metadata (``gguf_config``, ``gguf_tokenizer``); the resident tensors
are dequantized into the store's dtype (``gguf_tensors``; ``--resident-bits`` quantizes them as for any model); each
routed expert is sliced out of the stacked ``blk.N.ffn_{gate,up,down}_exps`` tensors and written as one blob per
precision. Blocks that fit the streamed precision go in with their own codes (``gguf_blocks``: q4_0 and q8_0
bit-exact with fp16 scales, q4_K bit-exact with fp32 ones in the portable layout); other types (q5_K, q6_K, ...)
are dequantized as the ``gguf`` package does (``GGUFFile.dequantize``) and quantized again by ``--method``. Written
atomically like every store: nothing is left at the target when it fails.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import cast

import numpy as np
import torch

from fate_edge.errors import FateEdgeError, ModelFormatError
from fate_edge.format.checkpoint import CheckpointReader
from fate_edge.format.checkpoint_layout import layer_names
from fate_edge.format.checksum import crc32
from fate_edge.format.convert import (
    GROUP_SIZES,
    ConvertOptions,
    StoreSource,
    _encode_scratch,
    _precisions,
    pick_group,
    write_store,
)
from fate_edge.format.gguf_blocks import FP32_SCALES, SOURCE_BITS, exact_into, to_packed, to_quantized
from fate_edge.format.gguf_config import hf_config
from fate_edge.format.gguf_expert_reads import ExpertReads
from fate_edge.format.gguf_reader import GGUFFile
from fate_edge.format.gguf_tensors import GGUFCheckpoint, expert_tensor
from fate_edge.format.gguf_tokenizer import tokenizer_files, write_tokenizer_files
from fate_edge.format.store import BIASES, MATRICES, Precision, as_mxfp4, encode_expert, plan_parts
from fate_edge.model.arch import config_from_dict
from fate_edge.model.experts import ExpertBias, ExpertWeights
from fate_edge.quant.mxfp4 import Mxfp4Weights, check_mxfp4, from_ggml

FLOAT_TYPES = ("F32", "F16", "BF16")


def expert_types(g: GGUFFile, layers: list[int]) -> Counter:
    """How many stacked expert tensors of each type the file holds (over ``layers``)."""
    return Counter(g.info(expert_tensor(layer, m)).type_name for layer in layers for m in MATRICES)


def default_bits(types: Counter) -> int:
    """The streamed precision a GGUF converts to unless asked: 8 for q8_0 experts, else 4."""
    return 8 if types.most_common(1)[0][0] == "Q8_0" else 4


# Resident tensors keep their file's width: 4-bit-or-less block types go to int4, wider quantized types to int8 (a
# float file's tensors take ConvertOptions' choice). q4_0 and q4_K blocks are requantized at the loader's group: the
# same 16 levels per block where a block spans its whole range, within one step otherwise.
NARROW_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_XXS", "IQ2_XS")


def resident_widths(g: GGUFFile, reader: GGUFCheckpoint) -> Callable[[list[str]], int | None]:
    """A fused resident group's width as its GGUF tensors hold it (the widest of them): 4 for q4 and narrower
    blocks, 8 for wider quantized blocks (q5, q6, q8), None (ConvertOptions decides) for float tensors."""

    def width(group: list[str]) -> int | None:
        kinds = {g.info(src).type_name for n in group for src in reader.sources.get(f"{n}.weight", ())}
        if not kinds or kinds & set(FLOAT_TYPES):
            return None
        return 4 if kinds <= set(NARROW_TYPES) else 8

    return width


def resident_dtype(g: GGUFFile) -> str:
    """The store's float dtype: float32 for an F32 file (its embeddings in F32), else bfloat16."""
    return "float32" if g.info("token_embd.weight").type_name == "F32" else "bfloat16"


def exact_scales(p: Precision, types: Counter, hidden: int, inter: int) -> Precision:
    """``p`` with fp32 scale and zero parts where blocks whose scales are exact in fp32 only (q4_K) go in with their
    own codes, in the portable layout (torch's layout holds bf16 whatever the store says). The precision's other
    matrices (a q6_K down projection quantized again, with fp16 scales) are exact in fp32 too, at 2 bytes more per
    group of 32."""
    if p.spec is None or p.layout != "portable" or not any(t in FP32_SCALES and exact_into(t, p.spec) for t in types):
        return p
    bias = any(part.name in BIASES for part in p.parts)
    parts, nbytes = plan_parts(p.bits, p.spec, hidden, inter, p.layout, "float32", bias=bias)
    return replace(p, parts=parts, blob_bytes=nbytes, scale_dtype="float32")


def keep_mxfp4(p: Precision, types: Counter, hidden: int, inter: int, layout: str) -> Precision:
    """``p`` in the mxfp4 layout where every expert tensor is MXFP4 (gpt-oss as llama.cpp writes it) and ``p`` is the
    4-bit precision of an ``auto`` layout: the blocks go in as they are, no second rounding."""
    if set(types) != {"MXFP4"} or p.bits != 4 or p.spec is None or layout != "auto":
        return p
    return as_mxfp4(p, hidden, inter)


def convert_gguf(
    path: str | Path,
    out_dir: str | Path,
    opts: ConvertOptions | None = None,
    progress: bool = True,
    on_progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write the expert store of the GGUF file ``path`` into ``out_dir``. ``opts.bits`` None: 8 for q8_0 experts,
    else 4; the group is 32 (the blocks' own) for quantized experts unless ``opts.group_size`` says otherwise."""
    path, out_dir = Path(path), Path(out_dir)
    opts = opts or ConvertOptions(bits=None)
    if out_dir.exists() and not opts.force:
        raise FateEdgeError(f"{out_dir}: already exists; choose another directory or pass --force to replace it")
    g = GGUFFile(path, drop_cache=True)
    dtype = resident_dtype(g)
    cfg = config_from_dict(hf_config(g, dtype), str(path))
    tok_files = tokenizer_files(g)
    # answers every call convert makes of a safetensors reader (names, ``in``, tensors by Hugging Face name)
    reader = cast(CheckpointReader, GGUFCheckpoint(g, cfg, getattr(torch, dtype)))
    names = layer_names(cfg, reader)
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    expected = {"gate": (e, i, h), "up": (e, i, h), "down": (e, h, i)}  # PyTorch's order
    for layer in cfg.moe_layers:
        for m in MATRICES:
            name = expert_tensor(layer, m)
            if name not in g.tensors:
                raise ModelFormatError(
                    f"{path}: tensor '{name}' not found; fate-edge reads the "
                    "stacked expert tensors llama.cpp writes (re-convert an older per-expert GGUF "
                    "with a current llama.cpp)"
                )
            if g.tensors[name].shape != expected[m]:
                raise ModelFormatError(
                    f"{path}: tensor '{name}' has shape {list(g.tensors[name].shape)}, expected {list(expected[m])} "
                    "(experts, rows, columns) from the metadata; the GGUF is damaged or its metadata is wrong"
                )
            bias = expert_tensor(layer, m, "bias")
            if cfg.expert_bias and (bias not in g.tensors or g.tensors[bias].shape != expected[m][:2]):
                raise ModelFormatError(
                    f"{path}: tensor '{bias}' is missing or not {list(expected[m][:2])} (experts, rows); gpt-oss's "
                    "experts have biases, the GGUF is incomplete"
                )
    widths = resident_widths(g, cast(GGUFCheckpoint, reader))
    embed_width = widths(["model.embed_tokens"])
    if opts.embedding_bits is not None and embed_width is not None:  # the table keeps its file's width too
        opts = replace(opts, embedding_bits=embed_width)
        if "lm_head.weight" not in reader:  # ... also where it is the head (write_store gives it the head's)
            opts = replace(opts, head_bits=opts.head_bits or embed_width)
    types = expert_types(g, cfg.moe_layers)
    blocks = not set(types) <= set(FLOAT_TYPES)
    if opts.bits is None:
        opts = replace(opts, bits=default_bits(types))
    dims = (cfg.hidden_size, cfg.moe_intermediate_size)
    group = opts.group_size or (32 if blocks else pick_group(dims, None))
    opts = replace(opts, group_size=group)
    if opts.cold_bits is not None:
        opts = replace(opts, cold_group_size=pick_group(dims, opts.cold_group_size, "--cold-group", smallest=True))
    asked = opts.layout
    if opts.layout == "auto" and blocks:
        opts = replace(opts, layout="portable")  # torch's layout holds bf16 scales: the blocks' fp16 ones would round
    precisions = [keep_mxfp4(exact_scales(p, types, *dims), types, *dims, asked) for p in _precisions(cfg, opts)]
    if progress:
        exact = [t for t in types if any(p.spec is not None and exact_into(t, p.spec) for p in precisions)]
        exact += ["MXFP4"] if any(p.layout == "mxfp4" for p in precisions) else []
        again = [t for t in types if t not in exact and t not in FLOAT_TYPES]
        print(
            f"{path.name}: experts {', '.join(f'{n} x{c}' for n, c in types.items())}; streamed int{opts.bits} "
            f"group {group}"
            + (f", {'/'.join(exact)} codes taken as they are" if exact else "")
            + (f", {'/'.join(again)} dequantized and quantized again ({opts.method})" if again else ""),
            file=sys.stderr,
        )
    one = cfg.moe_layers[0] if cfg.moe_layers else None
    expert_bytes = 0 if one is None else sum(g.info(expert_tensor(one, m)).nbytes for m in MATRICES) // cfg.num_experts

    def write_aux(tmp: Path) -> None:
        config = hf_config(g, dtype)
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        write_tokenizer_files(tok_files, tmp)

    reads = ExpertReads(g, cfg.moe_layers, cfg.num_experts)

    def encode(layer: int, expert: int, precs: list[Precision], method: str) -> list[tuple[memoryview, int]]:
        bias = expert_bias(g, layer, expert) if cfg.expert_bias else None
        blobs = encode_gguf_expert(g, layer, expert, precs, method, reads.expert(layer, expert), bias)
        return [(b, crc32(b)) for b in blobs]

    source = StoreSource(
        path,
        cfg,
        reader,
        names,
        expert_bytes,
        encode,
        write_aux,
        sum(len(json.dumps(c)) for c in tok_files.values()),
        widths,
    )
    try:
        return write_store(source, out_dir, opts, precisions, progress, on_progress)
    finally:
        reads.close()


def encode_gguf_expert(
    g: GGUFFile,
    layer: int,
    expert: int,
    precisions: list[Precision],
    method: str,
    source: dict[str, np.ndarray] | None = None,
    bias: ExpertBias | None = None,
) -> list[memoryview]:
    """One expert's blobs, one per precision: its blocks as they are where they fit, else dequantized. ``source``:
    the expert's raw bytes per matrix, already read (``ExpertReads``); else they are read here. ``bias``: gpt-oss's
    (:func:`expert_bias`)."""
    raw, floats = {}, {}
    for m in MATRICES:
        info = g.info(expert_tensor(layer, m))
        data = g.read_bytes(info.name, expert, 1).copy() if source is None else source[m]
        raw[m] = (info.type_name, info.shape[1], data.reshape(1, -1))
    out = []
    for p in precisions:
        mats = {}
        for m in MATRICES:
            kind, rows, data = raw[m]
            if p.layout == "mxfp4" and kind == "MXFP4":  # E2M1 codes and E8M0 scales as they are
                mats[m] = Mxfp4Weights(*from_ggml(torch.from_numpy(data.reshape(rows, -1))))
                try:
                    check_mxfp4(f"{g.path}: tensor '{expert_tensor(layer, m)}' (expert {expert})", *mats[m])
                except ValueError as exc:
                    raise ModelFormatError(str(exc)) from None
            elif p.spec is not None and exact_into(kind, p.spec):
                blocks = torch.from_numpy(data.reshape(rows, -1))
                packed = to_packed(kind, blocks, p.spec) if p.layout == "portable" else None
                mats[m] = packed if packed is not None else to_quantized(kind, blocks, p.spec)
            else:
                if m not in floats:
                    floats[m] = g.dequantize_bytes(expert_tensor(layer, m), data)[0]
                mats[m] = floats[m]
        w = ExpertWeights(mats["gate"], mats["up"], mats["down"], None, bias)
        out.append(encode_expert(w, p, method, _encode_scratch()))
    return out


def expert_bias(g: GGUFFile, layer: int, expert: int) -> ExpertBias:
    """gpt-oss's biases of one expert from the stacked ``ffn_{gate,up,down}_exps.bias`` (float32)."""
    gate, up, down = (g.dequantize(expert_tensor(layer, m, "bias"), expert, 1)[0] for m in MATRICES)
    return ExpertBias(torch.cat([gate, up]), down)


__all__ = ["GROUP_SIZES", "SOURCE_BITS", "convert_gguf", "default_bits", "encode_gguf_expert"]
