"""Routed experts read from a Hugging Face checkpoint: their tensor names (per-expert or fused), and a provider
that reads each expert when it is routed."""

from __future__ import annotations

import torch

from fate_edge.errors import MissingTensorError, ModelFormatError
from fate_edge.format.checkpoint import CheckpointReader
from fate_edge.model.arch.base import ModelConfig
from fate_edge.model.experts import (
    SILU,
    ExpertBias,
    ExpertProvider,
    ExpertWeights,
    Glu,
    InMemoryExpertProvider,
    quantize_expert,
)
from fate_edge.quant import QuantSpec
from fate_edge.quant.mxfp4 import Mxfp4Weights, check_mxfp4, dequantize_mxfp4

BIAS_NAMES = ("gate_up_proj_bias", "down_proj_bias")  # gpt-oss's expert biases, beside its matrices
# gpt-oss as published: each matrix MXFP4, ``<name>_blocks`` [E, rows, K/32, 16] and ``<name>_scales`` [E, rows, K/32]
MXFP4_NAMES = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")


def layouts_of(cfg: ModelConfig, reader: CheckpointReader, names: list) -> dict[int, ExpertLayout]:
    """Each MoE layer's :class:`ExpertLayout` (``names``: the layers' LayerNames)."""
    glu = Glu(cfg.swiglu_limit, cfg.swiglu_alpha)
    return {i: ExpertLayout(reader, names[i].mlp, cfg.experts_interleaved, glu) for i in cfg.moe_layers}


class ExpertLayout:
    """Tensor names of the routed experts in a checkpoint: per-expert 2-D tensors or fused 3-D ones.

    Handles ``mlp.experts.{j}.gate_proj/up_proj/down_proj`` (Qwen, OLMoE, DeepSeek),
    ``block_sparse_moe.experts.{j}.w1/w3/w2`` (Mixtral) and the transformers-5 fused layout
    ``experts.gate_up_proj`` [E, 2I, H] / ``experts.down_proj`` [E, H, I]; gpt-oss's (``interleaved``):
    ``experts.gate_up_proj`` [E, H, 2I] with gate and up in alternating columns, ``experts.down_proj`` [E, I, H] and
    their biases ``gate_up_proj_bias`` [E, 2I] (alternating too) and ``down_proj_bias`` [E, H]. ``glu``: the
    activation the experts read apply (gpt-oss's clamped SwiGLU). gpt-oss as published holds its two matrices in
    MXFP4 (``mxfp4``: :data:`MXFP4_NAMES`, rows in the transposed, [out, in] order, gate and up rows alternating),
    read as their blocks (no dequantized copy) where the caller asks for them as stored.
    """

    def __init__(self, reader: CheckpointReader, moe_prefix: str, interleaved: bool = False, glu: Glu = SILU):
        self.reader = reader
        self.prefix = moe_prefix
        self.interleaved, self.glu = interleaved, glu
        self.mxfp4 = interleaved and f"{moe_prefix}.experts.{MXFP4_NAMES[0]}" in reader
        if f"{moe_prefix}.experts.gate_up_proj" in reader or self.mxfp4:
            self.fused = True
            self.names: tuple[str, str, str] | None = None
        else:
            self.fused = False
            for names in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):
                if f"{moe_prefix}.experts.0.{names[0]}.weight" in reader:
                    self.names = names
                    break
            else:
                raise MissingTensorError(
                    f"{reader.model_dir}: no routed experts under '{moe_prefix}.experts' (looked for fused "
                    "gate_up_proj/down_proj and per-expert gate_proj|w1 tensors); the checkpoint is incomplete"
                )

    def check_shapes(self, experts: int, hidden: int, inter: int) -> None:
        """Every expert's tensors present with the shapes the config gives (read from the headers only): a
        transposed or cut matrix is named here, not found as garbage after convert."""
        if self.mxfp4:
            if hidden % 32 or inter % 32:
                raise ModelFormatError(
                    f"{self.reader.model_dir}: MXFP4 experts need hidden_size and intermediate_size in whole blocks "
                    f"of 32, not {hidden} and {inter}; the checkpoint and its config disagree"
                )
            gub, gus, db, ds, gate_up_bias, down_bias = self.tensor_names(0)
            want = {
                gub: [experts, 2 * inter, hidden // 32, 16],
                gus: [experts, 2 * inter, hidden // 32],
                db: [experts, hidden, inter // 32, 16],
                ds: [experts, hidden, inter // 32],
                gate_up_bias: [experts, 2 * inter],
                down_bias: [experts, hidden],
            }
        elif self.interleaved:
            gate_up, down, gate_up_bias, down_bias = self.tensor_names(0)
            want = {
                gate_up: [experts, hidden, 2 * inter],
                down: [experts, inter, hidden],
                gate_up_bias: [experts, 2 * inter],
                down_bias: [experts, hidden],
            }
        elif self.fused:
            gate_up, down = self.tensor_names(0)
            want = {gate_up: [experts, 2 * inter, hidden], down: [experts, hidden, inter]}
        else:
            want = {}
            for e in range(experts):
                g, u, d = self.tensor_names(e)
                want |= {g: [inter, hidden], u: [inter, hidden], d: [hidden, inter]}
        for name, shape in want.items():
            if name not in self.reader:
                raise MissingTensorError(
                    f"{self.reader.model_dir}: tensor '{name}' is missing; the checkpoint is incomplete"
                )
            got = list(self.reader.shape(name))
            if got != shape:
                raise ModelFormatError(
                    f"{self.reader.model_dir}: tensor '{name}' has shape {got}, expected {shape} from config.json "
                    "(hidden_size, moe_intermediate_size, num_experts); the checkpoint and its config disagree"
                )

    def tensor_names(self, expert: int) -> list[str]:
        if self.mxfp4:
            return [f"{self.prefix}.experts.{n}" for n in (*MXFP4_NAMES, *BIAS_NAMES)]
        if self.interleaved:
            return [f"{self.prefix}.experts.{n}" for n in ("gate_up_proj", "down_proj", *BIAS_NAMES)]
        if self.fused:
            return [f"{self.prefix}.experts.gate_up_proj", f"{self.prefix}.experts.down_proj"]
        assert self.names is not None
        return [f"{self.prefix}.experts.{expert}.{n}.weight" for n in self.names]

    def read(self, expert: int, dtype: torch.dtype | None) -> ExpertWeights:
        """Read one expert's three matrices, and nothing else, from disk (``dtype`` None: as stored, which for MXFP4
        experts is their blocks: :class:`Mxfp4Weights` matrices that only the store's encoder takes)."""
        if self.mxfp4:
            return self._read_mxfp4(expert, dtype)
        if self.interleaved:  # gpt-oss: [H, 2I] with gate and up alternating → [gate; up] rows [2I, H]
            gate_up_name, down_name, gate_up_bias, down_bias = self.tensor_names(expert)
            gu = self.reader.get_row(gate_up_name, expert, dtype)
            gb = self.reader.get_row(gate_up_bias, expert, dtype)
            bias = ExpertBias(torch.cat([gb[::2], gb[1::2]]), self.reader.get_row(down_bias, expert, dtype).clone())
            gate_up = torch.cat([gu[:, ::2].t(), gu[:, 1::2].t()])
            down = self.reader.get_row(down_name, expert, dtype).t().contiguous()
            return ExpertWeights.fused(gate_up, down, bias, self.glu)
        if self.fused:
            gate_up_name, down_name = self.tensor_names(expert)
            gate_up = self.reader.get_row(gate_up_name, expert, dtype)  # [2I, H]
            return ExpertWeights.fused(gate_up.contiguous(), self.reader.get_row(down_name, expert, dtype))
        g, u, d = (self.reader.get(n, dtype) for n in self.tensor_names(expert))
        return ExpertWeights.fused(torch.cat([g, u]), d)

    def _read_mxfp4(self, expert: int, dtype: torch.dtype | None) -> ExpertWeights:
        """gpt-oss's MXFP4 expert: gate and up rows de-interleaved on the blocks (whole rows: exact), down as stored;
        with ``dtype``, dequantized (exactly, as transformers does) into float matrices."""
        gub, gus, db, ds, gate_up_bias, down_bias = self.tensor_names(expert)
        mats = []
        for b_name, s_name in ((gub, gus), (db, ds)):
            blocks, scales = self.reader.get_row(b_name, expert), self.reader.get_row(s_name, expert)
            try:
                check_mxfp4(f"{self.reader.model_dir}: tensor '{b_name}' (expert {expert})", blocks, scales)
            except ValueError as exc:
                raise ModelFormatError(str(exc)) from None
            mats.append(Mxfp4Weights(blocks.reshape(blocks.shape[0], -1), scales))
        (gu_b, gu_s), down = mats
        gate, up = Mxfp4Weights(gu_b[::2], gu_s[::2]), Mxfp4Weights(gu_b[1::2], gu_s[1::2])
        gb = self.reader.get_row(gate_up_bias, expert, dtype)
        bias = ExpertBias(torch.cat([gb[::2], gb[1::2]]), self.reader.get_row(down_bias, expert, dtype).clone())
        if dtype is None:
            return ExpertWeights(gate, up, down, None, bias, self.glu)  # Mxfp4Weights: the encoder's input
        gate_up = dequantize_mxfp4(torch.cat([gate.blocks, up.blocks]), torch.cat([gate.scales, up.scales]), dtype)
        return ExpertWeights.fused(gate_up, dequantize_mxfp4(*down, dtype), bias, self.glu)


class CheckpointExpertProvider(ExpertProvider):
    """Reads each expert from the safetensors files when the router asks for it: load-on-demand, no cache.

    Memory stays at the resident weights plus the experts of the layer being computed; every call reads
    again (the OS page cache may still serve it; the fetch engine of the store path controls that).
    """

    def __init__(self, layouts: dict[int, ExpertLayout], dtype: torch.dtype, device: str | torch.device = "cpu"):
        self.layouts = layouts
        self.dtype = dtype
        self.device = device
        self.reads = 0
        self.bytes_read = 0

    def get(self, layer: int, expert: int) -> ExpertWeights:
        w = self.layouts[layer].read(expert, self.dtype).to(self.device)
        self.reads += 1
        self.bytes_read += w.nbytes
        return w


def read_experts(
    layouts: dict[int, ExpertLayout],
    num_experts: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    spec: QuantSpec | None = None,
    kernel: str | None = None,
) -> InMemoryExpertProvider:
    """Every expert read into memory; with ``spec``, each quantized as it is read (the float experts are
    never all in memory at once), on ``kernel`` (None: the fastest here, timed per shape)."""

    def one(lay: ExpertLayout, e: int):
        w = lay.read(e, dtype).to(device)
        return w if spec is None else quantize_expert(w, spec, device, kernel)

    return InMemoryExpertProvider(
        {(layer, e): one(lay, e) for layer, lay in layouts.items() for e in range(num_experts)}
    )
