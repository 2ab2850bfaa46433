"""Load a Hugging Face MoE model directory into a :class:`MoETransformer`."""

from __future__ import annotations

from pathlib import Path

import torch

from fate_edge.devices.link import ThrottledLink
from fate_edge.format.checkpoint import CheckpointReader
from fate_edge.format.checkpoint_experts import CheckpointExpertProvider, layouts_of, read_experts
from fate_edge.format.checkpoint_layout import (
    DTYPES,
    FP32_SUFFIXES,
    layer_names,
    required_tensors,
    resident_weight_names,
)
from fate_edge.format.convert import pick_group
from fate_edge.format.file_rows import FileRows
from fate_edge.format.prequantized import MappedFiles, check_request, covered, in_store, is_float_weight
from fate_edge.format.store import is_store
from fate_edge.model.arch import ModelConfig, load_config
from fate_edge.model.arch.base import OFFSET_NORMS
from fate_edge.model.embedding import NAME as EMBED_NAME
from fate_edge.model.embedding import quantize_table
from fate_edge.model.experts import ExpertProvider
from fate_edge.model.layer import Weights, quantize_group, resident_groups
from fate_edge.model.native_warm import warm_native_kernels
from fate_edge.model.transformer import MoETransformer
from fate_edge.quant import QuantSpec


def expert_spec(config: ModelConfig, bits: int) -> QuantSpec:
    """Group-wise spec for quantizing this model's experts in memory: the largest group that divides them."""
    return QuantSpec(bits, pick_group((config.hidden_size, config.moe_intermediate_size), None))


def _read_resident(
    config,
    reader: CheckpointReader,
    names: list,
    wanted: list[str],
    dtype: torch.dtype,
    device,
    resident_bits: int | None,
    embedding_bits: int | None = None,
) -> Weights:
    """The resident weights at ``dtype`` (routers fp32). With ``resident_bits`` each fused group is quantized
    as soon as it is read (lm_head first), so loading never holds every float weight at once: at
    Qwen1.5-MoE-A2.7B's size the bf16 resident weights (3.7 GB) would exceed the memory that the int4 ones
    (1.4 GB, ``footprint.memory_need``) are given."""
    if resident_bits not in (None, 8, 4):
        raise ValueError(f"resident_bits must be 8 or 4 (or None for the checkpoint's dtype), not {resident_bits}")
    resident = Weights()

    mapped = MappedFiles(reader)
    resident.row_sources = {}

    def read(name: str) -> torch.Tensor:  # codes and scales quantized at convert: memory-mapped as stored
        if not is_float_weight(name):
            if name.startswith(EMBED_NAME + ".") and torch.device(device).type == "cpu" and FileRows.available():
                assert resident.row_sources is not None
                resident.row_sources[name] = mapped.rows(name)
            # int4 codes the kernels stream every token: onto huge pages (huge_pages.moved_to_huge_pages); never the
            # embedding, whose rows are gathered (only those touched are resident)
            streamed = (
                name.endswith(".nint4") and not name.startswith(EMBED_NAME + ".") and torch.device(device).type == "cpu"
            )
            return mapped.get(name, streamed=streamed).to(device)
        return reader.get(name, torch.float32 if name.endswith(FP32_SUFFIXES) else dtype).to(device)

    check_request(reader, resident_bits, embedding_bits)
    groups = resident_groups(config, names, set(wanted)) if resident_bits is not None else []
    groups = [g for g in groups if not in_store(reader, g)]  # quantized at convert: read as they are
    for group in groups:
        assert resident_bits is not None  # groups is empty without it
        for n in group:
            dict.__setitem__(resident, f"{n}.weight", read(f"{n}.weight"))
        quantize_group(resident, group, resident_bits)
    quantized = {f"{n}.weight" for group in groups for n in group}
    for name in wanted:
        if name == "model.embed_tokens.weight" and embedding_bits is not None:  # rows quantized as they are read
            table = quantize_table(lambda a, b, n=name: reader.get_rows(n, a, b), reader.shape(name), embedding_bits)
            dict.update(resident, {k: t.to(device) for k, t in table.items()})
        elif name not in quantized:
            dict.__setitem__(resident, name, read(name))
    return resident


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype | str = torch.float32,
    experts: str | ExpertProvider = "memory",
    bits: int | None = None,
    link: ThrottledLink | None = None,
    device: str | torch.device = "cpu",
    resident_bits: int | None = None,
    compile: str = "off",
    embedding_bits: int | None = None,
) -> MoETransformer:
    """Load a Hugging Face model directory or an expert store.

    ``experts`` for a checkpoint: "memory" (all resident), "lazy" (read each from the safetensors files
    when routed), or any :class:`ExpertProvider`. An expert store (``fate-edge convert``) always streams
    experts through the fetch engine, at ``bits`` (default: its quantized precision), optionally over an
    emulated ``link``. With ``experts="memory"`` on a checkpoint, ``bits`` (8, 4, 3, 2) quantizes every
    routed expert in memory (round-to-nearest, the largest group of 128/64/32 dividing the expert sizes).
    ``resident_bits`` (8 or 4) quantizes the resident linears too (attention, dense MLPs, shared experts,
    lm_head); None keeps them in ``dtype``. ``embedding_bits`` (8 or 4): the embedding table held quantized
    (:mod:`fate_edge.model.embedding`). ``compile`` ("auto", "on", "off"): decode steps as one
    torch.compile'd graph when every expert is resident (:mod:`fate_edge.model.compiled_step`), compiled here."""
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    if isinstance(experts, str) and is_store(model_dir):
        from fate_edge.fetch.store_provider import StoreExpertProvider
        from fate_edge.format.store import ExpertStore

        experts = StoreExpertProvider(ExpertStore(model_dir), bits=bits, dtype=dtype, link=link, device=str(device))
    config = load_config(model_dir)
    reader = CheckpointReader(model_dir)
    names = layer_names(config, reader)
    wanted = resident_weight_names(config, reader)
    resident = _read_resident(config, reader, names, wanted, dtype, device, resident_bits, embedding_bits)
    if config.norm_offset:  # Qwen3-Next's norms scale by 1 + weight: held as that sum, in float32
        for name in [n for n in resident if n.endswith(OFFSET_NORMS)]:
            # kept in float32: the reference scales by (1 + weight) in float32 and rounds once (layer.rms_norm)
            dict.__setitem__(resident, name, (reader.get(name, torch.float32) + config.norm_offset).to(device))
    for required in required_tensors(config, names):
        if required not in wanted and not covered(reader, required):
            reader.get(required)  # raises MissingTensorError naming the tensor
    if isinstance(experts, str):
        layouts = layouts_of(config, reader, names)
        if experts == "memory":
            # bits: resident and quantized in memory (round-to-nearest), each expert as it is read
            spec = expert_spec(config, bits) if bits is not None and bits < 16 else None
            # the compiled decode graph calls torch's int4 kernel on stacked experts: give it those
            kernel = "torch-int4" if compile != "off" and spec is not None and device == "cpu" else None
            experts = read_experts(layouts, config.num_experts, dtype, device, spec, kernel)
        elif experts == "lazy":
            experts = CheckpointExpertProvider(layouts, dtype, device)
        else:
            raise ValueError(f"experts must be 'memory', 'lazy' or an ExpertProvider, not {experts!r}")
    model = MoETransformer(config, resident, experts, names, dtype)
    model.model_dir = Path(model_dir)
    if compile != "off":
        model.set_compile(compile)
    if torch.device(device).type == "cpu":
        warm_native_kernels()  # at load, not in the first request
    return model
