"""Tiny random checkpoints of the recurrent architectures (LFM2-MoE, Qwen3-Next, Qwen3.5-MoE text) built by
transformers, with the bundled model's tokenizer beside them, for tests that run them end to end."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch

ASSET = Path(__file__).resolve().parents[1] / "fate_edge" / "assets" / "tiny-moe"

_BASE = dict(
    vocab_size=4096,  # the bundled tokenizer's
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=False,
    num_hidden_layers=2,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
)
_DELTA = dict(
    head_dim=16,
    shared_expert_intermediate_size=48,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    layer_types=["linear_attention", "full_attention"],
)
CONFIGS = {
    "lfm2_moe": (
        "Lfm2MoeConfig",
        dict(layer_types=["conv", "full_attention"], intermediate_size=96, num_dense_layers=1),
    ),
    "qwen3_next": ("Qwen3NextConfig", dict(_DELTA, intermediate_size=96)),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", _DELTA),
}


def save_tiny(config, out: Path, perturb: Callable[[str, torch.Tensor], None] | None = None):
    """transformers' model of ``config`` (seeded), ``perturb(name, tensor)`` called on each buffer and parameter
    (under no_grad: to give weights that default to zeros or ones values that count), saved with the bundled
    tokenizer into ``out``."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    if perturb is not None:
        with torch.no_grad():
            for name, t in [*hf.named_buffers(), *hf.named_parameters()]:
                perturb(name, t)
    hf.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSET / name, out / name)
    return hf


def build_tiny(arch: str, out: Path):
    """The transformers model of ``arch`` (seeded), saved with the bundled tokenizer into ``out``."""
    import transformers

    cls, extra = CONFIGS[arch]
    return save_tiny(getattr(transformers, cls)(**{**_BASE, **extra}), out)
