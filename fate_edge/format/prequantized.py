"""Resident weights quantized once, at convert (``convert --resident-bits``), and read back as they are at load.

The store's resident.safetensors then holds, for each fused linear (``fused.resident_groups``), the tensors
``fused.quantize_group`` would leave in memory (``<group>.int8`` / ``.int4`` / ``.nint4`` with their scales, sizes
and group), and the embedding table as ``fate_edge.model.embedding`` holds it quantized; norms, routers and biases stay
as in the checkpoint. The loader reads those bytes straight into the tensors the model uses: no full-precision copy,
no quantization at load. A store written without the option holds float weights and loads as before.

The int4 layout is the one ``quantize_group`` picks on the converting host (fate-edge's native kernel layout where
that kernel runs: AVX512-VNNI or AVX2; torch's CPU int4 layout elsewhere); both load anywhere on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from fate_edge.errors import ModelFormatError
from fate_edge.format.checkpoint import CheckpointReader
from fate_edge.format.file_rows import FileRows
from fate_edge.huge_pages import moved_to_huge_pages
from fate_edge.model.arch import ModelConfig
from fate_edge.model.embedding import NAME as EMBED_NAME

# checkpoint tensors the loader casts to the compute dtype: weights and biases, gpt-oss's attention sinks, the
# fused expert tensors (transformers 5's and gpt-oss's ``experts.gate_up_proj``, ``down_proj``, their biases) and a
# DeltaNet layer's decay rates per head (A_log)
_FLOAT_SUFFIXES = ("weight", "bias", ".sinks", "_proj", "A_log")


def is_float_weight(name: str) -> bool:
    """A checkpoint weight or bias (cast to the compute dtype at load), not a quantized tensor's codes or scales."""
    return name.endswith(_FLOAT_SUFFIXES)


def in_store(reader: CheckpointReader, group: list[str]) -> bool:
    """Whether the fused ``group`` was quantized at convert."""
    return f"{'+'.join(group)}.sizes" in reader


def stored_bits(reader: CheckpointReader) -> tuple[int | None, int | None]:
    """(resident linears' bits, embedding table's bits) of a store written with ``convert --resident-bits``;
    None where the store holds floats."""
    keys = [k for k in reader.keys() if not is_float_weight(k)]
    embed = 8 if f"{EMBED_NAME}.int8" in reader else 4 if f"{EMBED_NAME}.int4" in reader else None
    linears = [k for k in keys if not k.startswith(EMBED_NAME) and k.endswith((".int8", ".int4", ".nint4"))]
    bits = None if not linears else 8 if linears[0].endswith(".int8") else 4
    return bits, embed


def check_request(reader: CheckpointReader, resident_bits: int | None, embedding_bits: int | None) -> None:
    """A load asking for other bits than the store was converted with is an error naming both fixes."""
    held, embed = stored_bits(reader)
    if held is not None and resident_bits not in (None, held):
        raise ModelFormatError(
            f"{reader.model_dir}: the resident weights were quantized to int{held} at convert; "
            f"load with --resident-bits {held} (or none), or convert again with --resident-bits none"
        )
    if embed is not None and embedding_bits not in (None, embed):
        raise ModelFormatError(
            f"{reader.model_dir}: the embedding table was quantized to int{embed} at convert; "
            f"load with --embedding-bits {embed} (or none), or convert again with --embedding-bits none"
        )


def covered(reader: CheckpointReader, name: str) -> bool:
    """Whether the checkpoint tensor ``name`` is in the store in quantized form."""
    if name == f"{EMBED_NAME}.weight":
        return stored_bits(reader)[1] is not None
    prefix = name.removesuffix(".weight")
    return any(k.endswith(".sizes") and prefix in k.removesuffix(".sizes").split("+") for k in reader.keys())


def quantized_resident(
    config: ModelConfig,
    reader: CheckpointReader,
    layer_names: list,
    wanted: list[str],
    bits: int | None,
    embedding_bits: int | None,
    widths: Callable[[list[str]], int | None] | None = None,
) -> dict[str, torch.Tensor]:
    """What convert writes for ``--resident-bits bits``, all held (``resident_writer.resident_items``, which
    convert streams): each fused group quantized as the loader would, the embedding table at ``embedding_bits``, the
    other tensors as stored. ``widths(group)``: that group's own bits (lm_head, a GGUF tensor's width), None for
    ``bits``; a group whose width comes out None stays as stored."""
    from fate_edge.format.resident_writer import held, resident_items

    return held(resident_items(config, reader, layer_names, wanted, bits, embedding_bits, widths), reader)


def write_quantized_resident(path: str | Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.clone() if v._base is not None else v for k, v in tensors.items()}, str(path), {"format": "pt"})


class MappedFiles:
    """Tensors of a store's safetensors files memory-mapped (MAP_PRIVATE), not read: quantized resident weights
    are used as stored, so their pages come from the page cache as the model first touches them, with no copy
    (as llama.cpp maps its file). Clean pages the kernel may drop under pressure and read again."""

    def __init__(self, reader: CheckpointReader):
        self.reader = reader
        self._maps: dict[str, torch.Tensor] = {}

    def _locate(self, name: str) -> tuple[Path, int, int, torch.dtype, list[int]]:
        """Where the stored tensor ``name`` lies: (file, first byte, end byte, dtype, shape)."""
        from fate_edge.format.checkpoint import _TORCH_DTYPES

        path = self.reader.model_dir / self.reader.weight_map[name]
        _, start, header = self.reader._layout(path)
        info = header[self.reader.stored.get(name, name)]  # a family's own name in the file (format.tensor_names)
        begin, end = (start + o for o in info["data_offsets"])
        return path, begin, end, _TORCH_DTYPES[info["dtype"]], info["shape"]

    def get(self, name: str, streamed: bool = False) -> torch.Tensor:
        """The stored tensor ``name``, a view of its file's mapping. ``streamed``: one the kernels read whole every
        token (int4 codes), moved onto huge pages instead, its file pages let go (``huge_pages.moved_to_huge_pages``;
        large ones, on Linux)."""
        path, begin, end, dtype, shape = self._locate(name)
        raw = self._maps.get(str(path))
        if raw is None:
            size = path.stat().st_size
            raw = self._maps[str(path)] = torch.empty(0, dtype=torch.uint8).set_(
                # torch's stubs type from_file's result as the storage base class, which set_ does not list
                torch.UntypedStorage.from_file(str(path), False, size)  # type: ignore[arg-type]
            )
        if begin % torch.empty(0, dtype=dtype).element_size():  # safetensors aligns each tensor; copy if not
            return self.reader.get(name)
        view = raw[begin:end].view(dtype).reshape(shape)
        return moved_to_huge_pages(view) if streamed else view  # only a view of the mapping: its pages are let go

    def rows(self, name: str) -> FileRows:
        """The stored tensor ``name`` as rows read from its file (``file_rows``): for a table gathered by row."""
        path, begin, _, dtype, shape = self._locate(name)
        return FileRows(path, begin, tuple(shape), dtype)


def stored_params(name: str, numel: int) -> int:
    """Weights a resident tensor stands for: its elements for a float one, two a byte for packed int4 codes, one
    for int8 codes, none for scales, zeros and bookkeeping (inspect's parameter count of such a store; int4 rows
    padded for torch's kernel count too)."""
    if is_float_weight(name):
        return numel
    return numel * {".int4": 2, ".nint4": 2, ".int8": 1}.get("." + name.rsplit(".", 1)[-1], 0)
