"""Write a synthetic checkpoint shaped like a published MoE model: config, tokenizer and streamed bf16 weights."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from fate_edge_lab.synthetic.layout import TensorSpec, shape_config, tensor_specs
from fate_edge_lab.synthetic.mxfp4_experts import QUANTIZATION_CONFIG, Mxfp4Blocks, mxfp4_specs
from fate_edge_lab.synthetic.presets import get_preset
from fate_edge_lab.synthetic.tokenizer import DEFAULT_BPE_VOCAB, TRAIN_CHARS, write_tokenizer
from fate_edge_lab.synthetic.weights import RouterStructure, WeightInit
from fate_edge_lab.synthetic.writer import DEFAULT_SHARD_BYTES, write_checkpoint


@dataclass
class SyntheticOptions:
    like: str  # a preset name (presets.PRESETS)
    layers: int | None = None  # trim num_hidden_layers; None: the published count
    seed: int = 0
    scale: int = 1  # divide every width by this (tests); 1: the published shapes
    max_shard_bytes: int = DEFAULT_SHARD_BYTES
    bpe_vocab: int = DEFAULT_BPE_VOCAB  # trained tokenizer size (ids still fit the published vocab_size)
    tokenizer_chars: int = TRAIN_CHARS  # stdlib source characters the tokenizer trains on
    structure: RouterStructure = field(default_factory=RouterStructure)
    mxfp4: bool = False  # gpt-oss's experts in MXFP4 as published (mxfp4_experts), not the float layout


def has_mxfp4(config: dict[str, Any]) -> bool:
    return config.get("model_type") == "gpt_oss"


def synthetic_config(opts: SyntheticOptions) -> dict[str, Any]:
    """The config.json the generator writes: the published one, widths / ``scale``, layers trimmed (with ``mxfp4``,
    the published quantization_config)."""
    config = shape_config(get_preset(opts.like).config, opts.scale, opts.layers)
    if opts.mxfp4:
        if not has_mxfp4(config):
            raise ValueError(f"--mxfp4: {opts.like} publishes no MXFP4 experts (gpt-oss does); leave it out")
        config["quantization_config"] = dict(QUANTIZATION_CONFIG)
    return config


def plan(opts: SyntheticOptions) -> tuple[dict[str, Any], list[TensorSpec], WeightInit]:
    """(config, tensors in checkpoint order, their initialiser) without writing anything."""
    config = synthetic_config(opts)
    return config, tensor_specs(config), WeightInit(config, opts.seed, opts.structure)


def make_synthetic_model(
    out: str | Path, opts: SyntheticOptions, on_tensor: Callable[[Any, int], None] | None = None
) -> dict[str, Any]:
    """Write the checkpoint to ``out``; returns the safetensors index (``metadata.total_size``: weight bytes)."""
    out = Path(out)
    preset = get_preset(opts.like)
    config, specs, init = plan(opts)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer(out, preset, config, opts.bpe_vocab, opts.tokenizer_chars)
    if opts.mxfp4:  # the experts' blocks and scales in place of their float tensors
        entries, blocks = mxfp4_specs(specs), Mxfp4Blocks(init.blocks)
        index = write_checkpoint(out, entries, blocks, torch.bfloat16, opts.max_shard_bytes, on_tensor)
    else:
        index = write_checkpoint(out, specs, init.blocks, torch.bfloat16, opts.max_shard_bytes, on_tensor)
    routing = {i: round(init.routing(i).entropy, 3) for i in init.cfg.moe_layers}
    meta = {
        "like": preset.name,
        "source": preset.source,
        "options": {**asdict(opts), "structure": None},
        "structure": asdict(opts.structure),
        "monte_carlo_usage_entropy": routing,
    }
    (out / "synthetic.json").write_text(json.dumps(meta, indent=2) + "\n")
    (out / "README.md").write_text(
        f"Synthetic checkpoint shaped like {preset.name} ({preset.source}): random bf16 weights"
        f"{' (experts in MXFP4, as published)' if opts.mxfp4 else ''} with trained-like "
        f"routing (skewed expert popularity, correlated layers), not a language model. Made by "
        f"fate_edge_lab.synthetic (make_synthetic_model); settings in synthetic.json.\n"
    )
    return index
