"""The expert store (output of ``fate-edge convert``): format, opening, validation, blob encode/decode.

Layout of a store directory (docs/architecture.md §4)::

    config.json, tokenizer files        copied from the source model
    resident.safetensors                everything that is not a routed expert
    experts-<bits>.bin                  one file per precision (16 = bf16 as trained, 4, 2, ...)
    store.json                          format version, quant specs, blob layout, and per expert
                                        (layer, expert, precision): offset, length, crc32

Each expert is one contiguous blob holding its three matrices (and their scales and zeros), starting
on a 4096-byte boundary so it can be read with O_DIRECT in one request. Every expert of a precision
has the same internal layout (``parts``), recorded once per precision.
"""

from __future__ import annotations

import ctypes
import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fate_edge.errors import ModelFormatError
from fate_edge.format.blob import ALIGN, BlobRef
from fate_edge.format.store_files import STORE_FILE
from fate_edge.model.arch.limits import LIMITS, positive_number
from fate_edge.model.experts import SILU, ExpertBias, ExpertWeights, Glu, QuantizedExpert
from fate_edge.quant import PackedQuantized, Quantized, QuantSpec, pack
from fate_edge.quant.block_order import BLOCK_ROWS, precision_lacks_block_order
from fate_edge.quant.linear import QuantizedLinear, default_kernel, host_int4_block_rows, int4_kernel_layout
from fate_edge.quant.methods import quantize_with
from fate_edge.quant.mxfp4 import (
    MXFP4,
    Mxfp4Linear,
    Mxfp4Weights,
    dequantize_mxfp4,
    native_mxfp4_status,
    quantize_mxfp4,
)
from fate_edge.small_files import read_small_text

FORMAT = "fate-edge-expert-store"
FORMAT_VERSION = 1
PART_ALIGN = 64
MATRICES = ("gate", "up", "down")
# gpt-oss's expert biases: float32 parts after the matrices, whatever precision the matrices are in
BIASES = ("gate_up.bias", "down.bias")
_DTYPES = {"uint8": torch.uint8, "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def is_store(path: str | Path) -> bool:
    return (Path(path) / STORE_FILE).exists()


@dataclass(frozen=True)
class Part:
    name: str  # e.g. "gate.codes", "gate.scale", "down.weight"
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    kind: str = ""  # what the bytes encode where the dtype does not say: "e2m1" codes, "e8m0" scales (PART_KINDS)


PART_KINDS = ("", "e2m1", "e8m0")  # a reader refuses a store whose parts name a kind it does not know
# Blob layouts of quantized experts:
#   portable  packed codes (low nibble first) + scale and zero per group, fp16 (or fp32 where a source's own
#             scales are exact only in fp32: a GGUF's q4_K): any device, any kernel.
#   cpu-int4  torch's CPU int4 kernel layout (codes pre-packed by _convert_weight_to_int4pack_for_cpu,
#             bf16 scale/zero pairs [K/g, N, 2]): same bytes, but decoding is a view, not a repack. The packer's
#             block order depends on the converting CPU (64 rows with AVX-512, 32 with AVX2 and ARM): the
#             precision records it (int4_block_rows) and a CPU of the other order re-packs on decode.
#   mxfp4     OCP MXFP4 as gpt-oss publishes it (quant.mxfp4): E2M1 codes two a byte [N, K/2] ("e2m1" parts) and one
#             E8M0 exponent byte per 32 weights [N, K/32] ("e8m0" parts); kept exact, computed on by its own kernel.
LAYOUTS = ("portable", "cpu-int4", "mxfp4")
SCALE_DTYPES = {"portable": ("float16", "float32"), "cpu-int4": ("bfloat16",), "mxfp4": ("uint8",)}  # first: default


@dataclass
class Precision:
    bits: int  # 16 means bf16 weights as trained
    file: str
    blob_bytes: int
    parts: list[Part]
    spec: QuantSpec | None  # None for bf16
    layout: str = "portable"
    scale_dtype: str = ""  # of the scale and zero parts; "": the layout's default (what stores without it hold)
    block_rows: int = 0  # cpu-int4: rows per block of the packer that wrote it (64 or 32); 0 elsewhere
    # the experts' activation (gpt-oss's clamped SwiGLU): the store's, not the precision's, and not in its JSON
    glu: Glu = field(default=SILU, compare=False)

    def __post_init__(self) -> None:
        allowed = SCALE_DTYPES.get(self.layout, ("float16",))
        self.scale_dtype = self.scale_dtype or allowed[0]
        if self.scale_dtype not in allowed:
            raise ValueError(f"the {self.layout} layout holds {' or '.join(allowed)} scales, not {self.scale_dtype}")

    @property
    def slot_bytes(self) -> int:
        return -(-self.blob_bytes // ALIGN) * ALIGN

    @functools.cached_property
    def view_plan(self) -> ViewPlan:
        """How :func:`part_views` lays each part over a blob, its parts checked once (``_view_plan``)."""
        return _view_plan(self.parts)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "bits": self.bits,
            "file": self.file,
            "blob_bytes": self.blob_bytes,
            "parts": [_part_json(p) for p in self.parts],
        }
        if self.spec is not None:
            d.update(
                group_size=self.spec.group_size,
                asymmetric=self.spec.asymmetric,
                layout=self.layout,
                scale_dtype=self.scale_dtype,
            )
        if self.layout == "cpu-int4":
            d[BLOCK_ROWS] = self.block_rows
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Precision:
        layout = d.get("layout", "portable")
        spec = QuantSpec(d["bits"], d["group_size"], d.get("asymmetric", True)) if d["bits"] < 16 else None
        spec = MXFP4 if layout == "mxfp4" else spec
        parts = [
            Part(p["name"], p["offset"], p["nbytes"], p["dtype"], tuple(p["shape"]), p.get("kind", ""))
            for p in d["parts"]
        ]
        return cls(
            d["bits"],
            d["file"],
            d["blob_bytes"],
            parts,
            spec,
            layout,
            d.get("scale_dtype", ""),
            d.get(BLOCK_ROWS, 0),
        )


def as_mxfp4(p: Precision, hidden: int, inter: int) -> Precision:
    """The 4-bit precision ``p`` in the mxfp4 layout (MXFP4 source experts kept as they are), biases kept."""
    bias = any(q.name in BIASES for q in p.parts)
    parts, nbytes = plan_parts(4, MXFP4, hidden, inter, "mxfp4", bias=bias)
    return Precision(4, p.file, nbytes, parts, MXFP4, "mxfp4", "uint8", glu=p.glu)


def _part_json(p: Part) -> dict[str, Any]:
    d = p.__dict__ | {"shape": list(p.shape)}
    if not p.kind:  # int stores keep the JSON they always had
        d.pop("kind")
    return d


def plan_parts(
    bits: int,
    spec: QuantSpec | None,
    hidden: int,
    inter: int,
    layout: str = "portable",
    scale_dtype: str = "float16",
    bias: bool = False,
) -> tuple[list[Part], int]:
    """Byte layout of one expert blob at ``bits``; ``scale_dtype``: of the portable layout's scales and zeros;
    ``bias``: gpt-oss's expert biases after the matrices (:data:`BIASES`, float32)."""
    scale_bytes = _DTYPES[scale_dtype].itemsize
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    parts, off = [], 0

    def add(name: str, dtype: str, shape: tuple[int, ...], itemsize: int, kind: str = "") -> None:
        nonlocal off
        n = itemsize
        for d in shape:
            n *= d
        parts.append(Part(name, off, n, dtype, shape, kind))
        off = -(-(off + n) // PART_ALIGN) * PART_ALIGN

    for m in MATRICES:
        n, k = shapes[m]
        if spec is None:
            add(f"{m}.weight", "bfloat16", (n, k), 2)
        elif layout == "mxfp4":
            if spec.kind != "mxfp4" or k % spec.group_size:
                raise ValueError(f"the mxfp4 layout holds MXFP4 matrices of whole 32-weight blocks, not {spec} {n}x{k}")
            add(f"{m}.blocks", "uint8", (n, k // 2), 1, "e2m1")
            add(f"{m}.scales", "uint8", (n, k // spec.group_size), 1, "e8m0")
        elif layout == "cpu-int4":
            add(f"{m}.packed", "uint8", (n, k // 2), 1)
            add(f"{m}.scale_zero", "bfloat16", (k // spec.group_size, n, 2), 2)
        else:
            add(f"{m}.codes", "uint8", (n, k * spec.storage_bits // 8), 1)
            add(f"{m}.scale", scale_dtype, (n, k // spec.group_size), scale_bytes)
            if spec.asymmetric:
                add(f"{m}.zero", scale_dtype, (n, k // spec.group_size), scale_bytes)
    if bias:
        add(BIASES[0], "float32", (2 * inter,), 4)
        add(BIASES[1], "float32", (hidden,), 4)
    return parts, off


def encode_expert(
    w: ExpertWeights, precision: Precision, method: str = "rtn", work: torch.Tensor | None = None
) -> memoryview:
    """Serialize one expert (bf16, or quantized by ``method``: "rtn" or "hqq") into its blob. A matrix of ``w``
    that is already a :class:`Quantized` in the precision's spec (a GGUF's blocks) goes in with its own codes.

    ``w`` may be in any float dtype (convert passes the checkpoint's own, no fp32 copy); ``work`` is an
    optional fp32 scratch buffer for the RTN encoder. Returns the blob's bytes (a view of a fresh buffer)."""
    out = torch.empty(precision.blob_bytes, dtype=torch.uint8)  # not zeros: filling is a pass over the blob
    tensors: dict[str, torch.Tensor] = {}
    for m in MATRICES:
        mat = getattr(w, m)
        if isinstance(mat, Mxfp4Weights) and precision.layout != "mxfp4":  # an int or bf16 copy of MXFP4 weights
            mat = dequantize_mxfp4(mat.blocks, mat.scales)
        if precision.spec is None:
            tensors[f"{m}.weight"] = mat.to(torch.bfloat16)
        elif precision.layout == "mxfp4":  # MXFP4 weights go in as they are; float ones are encoded (llama.cpp's way)
            tensors[f"{m}.blocks"], tensors[f"{m}.scales"] = (
                mat if isinstance(mat, Mxfp4Weights) else quantize_mxfp4(mat)
            )
        elif precision.layout == "cpu-int4":
            q = mat if isinstance(mat, Quantized) else quantize_with(method, mat, precision.spec, work)
            tensors[f"{m}.packed"], tensors[f"{m}.scale_zero"] = int4_kernel_layout(
                q, precision.spec, rows=precision.block_rows
            )
        else:
            if isinstance(mat, PackedQuantized):  # packed already, as pack() below would
                q, tensors[f"{m}.codes"] = mat, mat.packed
            else:
                q = mat if isinstance(mat, Quantized) else quantize_with(method, mat, precision.spec, work)
                tensors[f"{m}.codes"] = pack(q.codes, precision.spec.storage_bits)
            scale_dtype = _DTYPES[precision.scale_dtype]  # fp32 scales (q4_K's) round here in an fp16 store
            tensors[f"{m}.scale"] = q.scale.to(scale_dtype)
            if q.zero is not None:
                tensors[f"{m}.zero"] = q.zero.to(scale_dtype)
    if any(p.name in BIASES for p in precision.parts):
        if w.bias is None:
            raise ValueError("this store's blobs hold expert biases, and the expert has none")
        tensors[BIASES[0]], tensors[BIASES[1]] = w.bias.gate_up.float(), w.bias.down.float()
    end = 0
    for p in sorted(precision.parts, key=lambda p: p.offset):
        raw = tensors[p.name].contiguous().view(-1).view(torch.uint8)
        assert raw.numel() == p.nbytes, (p.name, raw.numel(), p.nbytes)
        out[end : p.offset] = 0  # alignment padding: the only bytes no part writes
        out[p.offset : p.offset + p.nbytes] = raw
        end = p.offset + p.nbytes
    out[end:] = 0
    return out.numpy().data


_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
_BLOB_MMAP_THRESHOLD = 1 << 20


def set_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` (blocks that large or larger are mappings of their own, unmapped on
    free); returns whether glibc took the setting."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, nbytes))
    except (OSError, AttributeError):  # not glibc: its allocator has no such setting to fix
        return False


def return_freed_blobs_to_the_os() -> bool:
    """Fix glibc's mmap threshold at 1 MiB, so every expert-sized block is its own mapping, unmapped on free.

    By default glibc raises the threshold to the size of the first large block freed (up to 32 MB), and
    later blobs come from the heap, where freed ones stay resident behind small live allocations: at real
    shapes RSS grew ~50 MB per decoded token past the budget. Returns whether glibc took the setting."""
    return set_mmap_threshold(_BLOB_MMAP_THRESHOLD)


def blob_tensor(payload: memoryview) -> torch.Tensor:
    """A private CPU copy of a blob's bytes (the pool buffer behind ``payload`` is about to be reused)."""
    return torch.frombuffer(payload, dtype=torch.uint8).clone()


def decodes_to_views(precision: Precision) -> bool:
    """Whether :func:`decode_expert` on the CPU returns views of the blob, copying nothing: torch's kernel layout,
    or the portable int4 layout where fate-edge's native kernel computes on the stored bytes (every matrix)."""
    spec = precision.spec
    if spec is None:
        return False
    if precision.layout == "cpu-int4":
        return precision.block_rows == host_int4_block_rows()  # another CPU's block order: re-packed, not viewed
    if precision.layout == "mxfp4":
        return native_mxfp4_status()[0]
    codes = [p.shape for p in precision.parts if p.name.endswith(".codes")]
    return (
        spec.storage_bits == 4
        and bool(codes)
        and all(default_kernel((n, width * 2), spec, "cpu") == "native-int4" for n, width in codes)
    )


def part_views(blob: torch.Tensor, precision: Precision) -> dict[str, torch.Tensor]:
    """Each part of a blob (a uint8 tensor) of ``precision`` as a view of it in the part's dtype and shape: one
    strided view a part, on one dtype view of the blob per dtype. A slice, a dtype view and a reshape a part were
    three dispatcher calls, about twice the time (a read's decode, paid on every cache miss;
    docs/measured-choices.md)."""
    plan, end = precision.view_plan
    if blob.numel() < end:
        raise ModelFormatError(
            f"a blob of {blob.numel()} bytes is shorter than its parts ({end} bytes); the store is damaged, "
            "re-run fate-edge convert"
        )
    bases: dict[torch.dtype, torch.Tensor] = {}
    out = {}
    for name, dtype, shape, strides, at in plan:
        base = bases.get(dtype)
        if base is None:
            size = dtype.itemsize
            base = bases[dtype] = blob if size == 1 else blob[: blob.numel() // size * size].view(dtype)
        out[name] = base.as_strided(shape, strides, base.storage_offset() + at)
    return out


# Per part: name, dtype, shape, strides, offset in elements; and the bytes the parts span
ViewPlan = tuple[list[tuple[str, torch.dtype, tuple, tuple, int]], int]


def _view_plan(parts: list[Part]) -> ViewPlan:
    """The :data:`ViewPlan` of ``parts``, each checked to be a whole array of its dtype."""
    plan, end = [], 0
    for p in parts:
        dtype = _DTYPES[p.dtype]
        size = dtype.itemsize
        strides, step = [], 1
        for dim in reversed(p.shape):
            strides.append(step)
            step *= dim
        if p.offset % size or step * size != p.nbytes or p.offset < 0:
            raise ModelFormatError(
                f"part {p.name} ({p.nbytes} bytes at {p.offset}, {p.dtype} {list(p.shape)}) is not a whole "
                f"{p.dtype} array; the store is damaged, re-run fate-edge convert"
            )
        plan.append((p.name, dtype, tuple(p.shape), tuple(strides[::-1]), p.offset // size))
        end = max(end, p.offset + p.nbytes)
    return plan, end


def decode_expert(
    blob: torch.Tensor | memoryview, precision: Precision, dtype: torch.dtype, device: torch.device | str | None = None
) -> ExpertWeights | QuantizedExpert:
    """Turn a blob into a callable expert on ``device`` (default: where ``blob`` is).

    ``blob`` is a uint8 tensor holding the blob (on the CPU, or already copied to the GPU) or a
    memoryview of a pool buffer, which is copied out first. Parts are views into it, decoded in place.
    """
    if isinstance(blob, memoryview):
        blob = blob_tensor(blob)
    device = torch.device(device) if device is not None else blob.device
    blob = blob.to(device, non_blocking=True)
    t = part_views(blob, precision)
    bias, glu = None, precision.glu
    if BIASES[0] in t:  # in the model's dtype, as the reference holds them (float32 in the blob)
        bias = ExpertBias(t[BIASES[0]].to(dtype), t[BIASES[1]].to(dtype))
    if precision.spec is None:
        gate, up, down = (t[f"{m}.weight"].to(dtype) for m in MATRICES)
        return ExpertWeights(gate, up, down, None, bias, glu)
    spec = precision.spec
    if precision.layout == "mxfp4":  # the blocks as stored: the native kernel on the CPU, dequantized elsewhere
        kernel = "" if device.type == "cpu" else "dequant"
        gate, up, down = (Mxfp4Linear(t[f"{m}.blocks"], t[f"{m}.scales"], kernel) for m in MATRICES)
        return QuantizedExpert(gate, up, down, None, bias, glu)
    if precision.layout == "cpu-int4":  # on another device, re-packed there for its kernel (one store, any device)
        lins = [
            QuantizedLinear.from_cpu_kernel_layout(
                t[f"{m}.packed"], t[f"{m}.scale_zero"], spec, device, rows=precision.block_rows
            )
            for m in MATRICES
        ]
        return QuantizedExpert(lins[0], lins[1], lins[2], None, bias, glu)
    lins = [
        QuantizedLinear.from_packed(t[f"{m}.codes"], t[f"{m}.scale"], t.get(f"{m}.zero"), spec, device)
        for m in MATRICES
    ]
    return QuantizedExpert(lins[0], lins[1], lins[2], None, bias, glu)


# a store's counts within the bounds a config's are held to
MAX_EXPERTS, MAX_LAYERS = LIMITS["num_experts"][1], LIMITS["num_hidden_layers"][1]
_BLOB_FILE = re.compile(r"experts-\d{1,2}\.bin")  # what convert writes; nothing with a separator or ".."
INDEX_MAX_BYTES = 256 << 20
_INDEX_FIELDS = {"precisions": dict, "experts": dict, "moe_layers": list, "num_experts": int}
_PRECISION_FIELDS = {"bits": int, "file": str, "blob_bytes": int, "parts": list}
_PART_FIELDS = {"name": str, "offset": int, "nbytes": int, "dtype": str, "shape": list}
_BLOB_FIELDS: dict[str, type] = {"layer": int, "expert": int, "offset": int, "length": int, "crc32": int}


def _check_fields(d: object, spec: dict[str, type], where: str, index_path: Path) -> None:
    if not isinstance(d, dict):
        raise ModelFormatError(f"{index_path}: {where} is not an object; the file is damaged, re-run fate-edge convert")
    for key, kind in spec.items():
        value = d.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            problem = "is missing" if key not in d else f"is {value!r}, not a {kind.__name__}"
            raise ModelFormatError(
                f"{index_path}: field {where}.{key} {problem}; the file is damaged, re-run fate-edge convert"
            )


def _check_scale_dtype(d: dict, where: str, index_path: Path) -> None:
    """A quantized precision's layout and scale dtype (absent in older stores: the layout's default)."""
    layout = d.get("layout", "portable")
    if layout not in SCALE_DTYPES:
        raise ModelFormatError(
            f"{index_path}: field {where}.layout is {layout!r}, not one of {', '.join(LAYOUTS)}; the store was "
            "written by a newer fate-edge or is damaged, re-run fate-edge convert"
        )
    dtype = d.get("scale_dtype", SCALE_DTYPES[layout][0])
    if dtype not in SCALE_DTYPES[layout]:
        raise ModelFormatError(
            f"{index_path}: field {where}.scale_dtype is {dtype!r}, not one of {', '.join(SCALE_DTYPES[layout])} "
            f"(the {layout} layout's); the store was written by a newer fate-edge or is damaged, re-run fate-edge "
            "convert"
        )


def _check_block_rows(d: dict, where: str, index_path: Path) -> None:
    """A cpu-int4 precision's block order (64 or 32 rows, the converting CPU's). Stores written before it was
    recorded are refused: their bytes decode wrong on a CPU of the other order while every checksum passes, and
    nothing in them says which order they hold (docs/quantization.md)."""
    if d.get("layout") != "cpu-int4":
        return
    if precision_lacks_block_order(d):
        raise ModelFormatError(
            f"{index_path}: its cpu-int4 experts do not record the CPU block order they were packed in (a store "
            "from before fate-edge recorded it), so they may decode wrong on this CPU; re-run fate-edge convert"
        )
    rows = d[BLOCK_ROWS]
    if rows not in (32, 64) or isinstance(rows, bool):
        raise _damaged(index_path, f"field {where}.{BLOCK_ROWS} is {rows!r}, not 64 or 32")


def _damaged(index_path: Path, what: str) -> ModelFormatError:
    return ModelFormatError(f"{index_path}: {what}; the file is damaged, re-run fate-edge convert")


def _check_index(index: dict, index_path: Path) -> None:
    """Every field the store reads, with its type and range, so a damaged store.json is named, not an
    AttributeError, and no path in it leads outside the store."""
    _check_fields(index, _INDEX_FIELDS, "store", index_path)
    if not 1 <= index["num_experts"] <= MAX_EXPERTS:
        raise _damaged(index_path, f"field store.num_experts is {index['num_experts']}, expected 1..{MAX_EXPERTS}")
    layers = index["moe_layers"]
    if len(layers) > MAX_LAYERS or not all(isinstance(x, int) and 0 <= x < MAX_LAYERS for x in layers):
        raise _damaged(index_path, f"field store.moe_layers is not a list of layer numbers below {MAX_LAYERS}")
    for bits, d in index["precisions"].items():
        _check_fields(
            d,
            _PRECISION_FIELDS | ({"group_size": int} if d.get("bits", 16) < 16 else {}),
            f"precisions.{bits}",
            index_path,
        )
        if not _BLOB_FILE.fullmatch(d["file"]):
            raise _damaged(
                index_path, f"field precisions.{bits}.file is {d['file'][:60]!r}, not a blob file name inside the store"
            )
        for i, part in enumerate(d["parts"]):
            _check_fields(part, _PART_FIELDS, f"precisions.{bits}.parts[{i}]", index_path)
            if part.get("kind", "") not in PART_KINDS:
                raise ModelFormatError(
                    f"{index_path}: field precisions.{bits}.parts[{i}].kind is {part['kind']!r}, not one of "
                    f"{', '.join(k for k in PART_KINDS if k)}; the store was written by a newer fate-edge or is "
                    "damaged, re-run fate-edge convert"
                )
            if part["dtype"] not in _DTYPES:
                raise ModelFormatError(
                    f"{index_path}: field precisions.{bits}.parts[{i}].dtype is {part['dtype']!r}, not one of "
                    f"{', '.join(_DTYPES)}; the store was written by a newer fate-edge or is damaged, re-run "
                    "fate-edge convert"
                )
        if d["bits"] < 16:
            _check_scale_dtype(d, f"precisions.{bits}", index_path)
            _check_block_rows(d, f"precisions.{bits}", index_path)
    for bits, entries in index["experts"].items():
        if bits not in index["precisions"] or not isinstance(entries, list):
            raise ModelFormatError(
                f"{index_path}: field experts.{bits} has no precisions.{bits} entry or is not a "
                "list; the file is damaged, re-run fate-edge convert"
            )
        for i, e in enumerate(entries):
            _check_fields(e, _BLOB_FIELDS, f"experts.{bits}[{i}]", index_path)
            if (
                e["offset"] < 0
                or e["length"] < 0
                or e["layer"] not in layers
                or not 0 <= e["expert"] < index["num_experts"]
            ):
                raise _damaged(index_path, f"experts.{bits}[{i}] names a place or an expert outside the store")


class ExpertStore:
    """An opened, validated store: where every (layer, expert, precision) blob lives."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        return_freed_blobs_to_the_os()  # blobs are allocated and freed all the time from here on
        index_path = self.path / STORE_FILE
        if not index_path.exists():
            raise ModelFormatError(f"{index_path}: not found; create a store with `fate-edge convert MODEL OUT`")
        try:
            index = json.loads(read_small_text(index_path, INDEX_MAX_BYTES))
        except json.JSONDecodeError as exc:
            raise ModelFormatError(f"{index_path}: invalid JSON ({exc}); re-run fate-edge convert") from exc
        if not isinstance(index, dict):
            raise ModelFormatError(
                f"{index_path}: holds a JSON {type(index).__name__}, not the store's object; re-run fate-edge convert"
            )
        if index.get("format") != FORMAT or index.get("format_version") != FORMAT_VERSION:
            raise ModelFormatError(
                f"{index_path}: format {index.get('format')!r} v{index.get('format_version')} is not "
                f"{FORMAT!r} v{FORMAT_VERSION}; re-run fate-edge convert with this version"
            )
        _check_index(index, index_path)
        self.index = index
        self.precisions = {int(b): Precision.from_json(d) for b, d in index["precisions"].items()}
        if index.get("swiglu_limit") is not None:  # gpt-oss's clamped SwiGLU, for every precision's experts
            where = f"{index_path}: field store.swiglu"
            glu = Glu(
                positive_number(index["swiglu_limit"], f"{where}_limit"),
                positive_number(index.get("swiglu_alpha", 1.702), f"{where}_alpha"),
            )
            for p in self.precisions.values():
                p.glu = glu
        self.refs: dict[tuple[int, int, int], BlobRef] = {}
        for bits_s, entries in index["experts"].items():
            bits = int(bits_s)
            file = str(self.path / self.precisions[bits].file)
            for e in entries:
                ref = BlobRef(file, e["offset"], e["length"], e["crc32"], e["layer"], e["expert"], bits)
                self.refs[ref.key] = ref
        self._check_files()

    def _check_files(self) -> None:
        for bits, prec in self.precisions.items():
            path = self.path / prec.file
            if not path.exists():
                raise ModelFormatError(f"{path}: missing from the store; re-run fate-edge convert")
            if not path.is_file():
                raise ModelFormatError(f"{path}: not a regular file; re-run fate-edge convert")
            size = path.stat().st_size
            short = [r for r in self.refs.values() if r.bits == bits and r.offset + r.read_length > size]
            if short:
                first = min(short, key=lambda r: r.offset)
                raise ModelFormatError(
                    f"{path}: truncated to {size} bytes; {len(short)} expert blobs are cut off, the first is "
                    f"layer {first.layer} expert {first.expert} at offset {first.offset}; re-run fate-edge convert"
                )

    @property
    def bits_available(self) -> list[int]:
        return sorted(self.precisions)

    @property
    def max_blob_bytes(self) -> int:
        return max(p.slot_bytes for p in self.precisions.values())

    def ref(self, layer: int, expert: int, bits: int) -> BlobRef:
        try:
            return self.refs[(layer, expert, bits)]
        except KeyError:
            raise ModelFormatError(
                f"{self.path}: no int{bits} blob for layer {layer} expert {expert}; available precisions: "
                f"{self.bits_available}"
            ) from None

    def expert_bytes(self, bits: int) -> int:
        """Bytes of one expert's blob at ``bits`` (what a fetch moves)."""
        return self.precisions[bits].blob_bytes

    def verify(self, bits: list[int] | None = None) -> int:
        """Check every blob's CRC (of ``bits``, default all precisions); raise CorruptBlobError naming the first
        bad one. Verified blobs are not checked again on their reads in this process. Returns bytes checked."""
        from fate_edge.format.blob import file_identity, mark_verified

        checked = 0
        for b in bits or self.bits_available:
            refs = sorted((r for r in self.refs.values() if r.bits == b), key=lambda r: r.offset)
            if not refs:
                continue
            with open(refs[0].path, "rb") as f:
                identity = file_identity(f.fileno())
                for r in refs:
                    f.seek(r.offset)
                    mark_verified(r, f.read(r.length), identity)
                    checked += r.length
        return checked
