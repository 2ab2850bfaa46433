"""Bounds on a model's counts and sizes, checked before anything is built from them.

A config.json or GGUF header is input from outside: ``num_hidden_layers: 2**40`` must be one error line, not a
list of 2**40 layers, and ``num_attention_heads: 0`` not a ZeroDivisionError. The bounds are far above any
published model (DeepSeek-V3: 61 layers, 256 experts, 7168 wide, a 129k vocabulary) and far below what would
exhaust memory before a single weight is read.
"""

from __future__ import annotations

import math
from typing import Any

from fate_edge.errors import ModelFormatError

K, M = 1 << 10, 1 << 20
# every spelling of a count or size a parser reads -> (least, most)
LIMITS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 4 * M),
    "hidden_size": (1, 64 * K),
    "d_model": (1, 64 * K),
    "num_hidden_layers": (1, K),
    "n_layer": (1, K),
    "num_layers": (1, K),
    "num_attention_heads": (1, K),
    "n_head": (1, K),
    "num_key_value_heads": (1, K),
    "num_kv_heads": (1, K),
    "head_dim": (1, 4 * K),
    "intermediate_size": (0, M),
    "moe_intermediate_size": (1, M),
    "shared_expert_intermediate_size": (0, M),
    "num_local_experts": (1, 16 * K),
    "num_experts": (1, 16 * K),
    "n_routed_experts": (1, 16 * K),
    "moe_num_experts": (1, 16 * K),
    "moe_k": (1, 16 * K),
    "moe_num_shared_experts": (0, K),
    "moe_layer_interval": (1, K),
    "num_experts_per_tok": (1, 16 * K),
    "moe_topk": (1, 16 * K),
    "top_k": (1, 16 * K),
    "max_position_embeddings": (1, 16 * M),
    "max_seq_len": (1, 16 * M),
    "first_k_dense_replace": (0, K),
    "moe_layer_freq": (1, K),
    "decoder_sparse_step": (1, K),
    "n_group": (1, 16 * K),
    "topk_group": (1, 16 * K),
    "n_shared_experts": (0, K),
    "kv_lora_rank": (1, 64 * K),
    "q_lora_rank": (1, 64 * K),
    "qk_nope_head_dim": (1, 4 * K),
    "qk_rope_head_dim": (1, 4 * K),
    "v_head_dim": (1, 4 * K),
    "sliding_window": (0, 16 * M),  # Qwen2 writes 0 for none
}
LAYER_LISTS = ("mlp_only_layers",)


def bounded_int(value: Any, where: str, least: int, most: int) -> int:
    """``value`` when it is an integer in [least, most]; else one error naming ``where``, the value and the range."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelFormatError(f"{where} is {_show(value)}, not an integer; expected {least}..{most}")
    if not least <= value <= most:
        raise ModelFormatError(f"{where} is {value}; expected {least}..{most} (the file is damaged or not a model)")
    return value


def check_raw_config(d: dict[str, Any], source: str) -> None:
    """Every count and size of a config.json dict within :data:`LIMITS`, before a parser builds anything."""
    for key, (least, most) in LIMITS.items():
        if d.get(key) is not None:
            bounded_int(d[key], f"{source}: '{key}'", least, most)
    layers = d.get("num_hidden_layers", d.get("n_layer", d.get("num_layers", 1)))
    for key in LAYER_LISTS:
        value = d.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or len(value) > LIMITS["num_hidden_layers"][1]:
            raise ModelFormatError(f"{source}: '{key}' is {_show(value)}; expected a list of layer numbers")
        for i, layer in enumerate(value):
            bounded_int(layer, f"{source}: '{key}'[{i}]", 0, max(int(layers) - 1, 0))
    for key in ("rms_norm_eps", "layer_norm_eps", "rope_theta"):
        value = d.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0
        ):
            raise ModelFormatError(f"{source}: '{key}' is {_show(value)}; expected a positive number")


def check_config(cfg: Any, source: str) -> None:
    """The relations between a normalised config's fields (each already within its bounds)."""
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ModelFormatError(
            f"{source}: {cfg.num_attention_heads} attention heads are not a multiple of "
            f"{cfg.num_key_value_heads} key/value heads; the config is damaged"
        )
    if cfg.num_experts_per_tok > cfg.num_experts:
        raise ModelFormatError(
            f"{source}: {cfg.num_experts_per_tok} experts per token (num_experts_per_tok) but only "
            f"{cfg.num_experts} experts; the config is damaged"
        )
    if cfg.n_group > 1 and (cfg.num_experts % cfg.n_group or cfg.topk_group > cfg.n_group):
        raise ModelFormatError(
            f"{source}: {cfg.num_experts} experts in n_group={cfg.n_group} groups choosing topk_group="
            f"{cfg.topk_group}: the groups must divide the experts and topk_group <= n_group"
        )
    if not cfg.moe_layers:
        raise ModelFormatError(
            f"{source}: none of its {cfg.num_hidden_layers} layers has experts (all dense); fate-edge runs "
            "Mixture-of-Experts models"
        )


def check_layer_types(types: Any, layers: int, source: str, kinds: tuple[str, ...]) -> None:
    """``layer_types`` (gpt-oss: which layers attend over a sliding window): one known kind per layer."""
    if not isinstance(types, list) or len(types) != layers:
        raise ModelFormatError(
            f"{source}: 'layer_types' is {_show(types)}; expected a list of {layers} entries (one per layer) of "
            f"{' / '.join(kinds)}"
        )
    for i, kind in enumerate(types):
        if kind not in kinds:
            raise ModelFormatError(f"{source}: 'layer_types'[{i}] is {_show(kind)}; expected one of {', '.join(kinds)}")


def positive_number(value: Any, where: str) -> float:
    """``value`` as a float when it is a finite positive number; else one error naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ModelFormatError(f"{where} is {_show(value)}; expected a positive number")
    return float(value)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
