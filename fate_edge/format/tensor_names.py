"""Checkpoint tensor names of families that spell the common modules differently, read as the common names.

The forward pass, the loader and convert read one naming (``model.norm``, ``self_attn.o_proj``, ``mlp.gate_proj``,
``input_layernorm``, ...). A family whose checkpoints name them otherwise lists its renames here, and
``CheckpointReader`` serves its tensors under the common names, so nothing downstream knows the difference."""

from __future__ import annotations

import json
import re
from pathlib import Path

# model_type -> (pattern, replacement), applied in order to every tensor name
_RENAMES: dict[str, list[tuple[re.Pattern[str], str]]] = {
    # Qwen3.5 MoE's multimodal checkpoint: the text model under model.language_model
    "qwen3_5_moe": [(re.compile(r"^model\.language_model\."), "model.")],
    "lfm2_moe": [
        (re.compile(p), r)
        for p, r in [
            (r"^model\.embedding_norm\.", "model.norm."),
            (r"\.operator_norm\.", ".input_layernorm."),
            (r"\.ffn_norm\.", ".post_attention_layernorm."),
            (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."),
            (r"\.self_attn\.q_layernorm\.", ".self_attn.q_norm."),
            (r"\.self_attn\.k_layernorm\.", ".self_attn.k_norm."),
            (r"\.feed_forward\.w1\.", ".mlp.gate_proj."),  # the dense MLP (experts keep w1/w3/w2)
            (r"\.feed_forward\.w3\.", ".mlp.up_proj."),
            (r"\.feed_forward\.w2\.", ".mlp.down_proj."),
            (r"\.feed_forward\.expert_bias$", ".mlp.e_score_correction_bias"),
            (r"\.feed_forward\.", ".mlp."),
        ]
    ],
}


def model_type_of(model_dir: Path) -> str | None:
    """config.json's model_type, or None where there is none to read (the loader reports a bad config itself)."""
    try:
        d = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return d.get("model_type") if isinstance(d, dict) else None


def common_names(model_type: str | None, names: list[str]) -> dict[str, str]:
    """{common name: stored name} for the stored tensor ``names`` a family renames (empty: none renamed)."""
    rules = _RENAMES.get(model_type or "")
    if not rules:
        return {}
    out = {}
    for stored in names:
        name = stored
        for pattern, repl in rules:
            name = pattern.sub(repl, name, count=1)
        if name != stored:
            out[name] = stored
    return out
