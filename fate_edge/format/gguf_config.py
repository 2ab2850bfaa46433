"""A GGUF file's metadata as the Hugging Face ``config.json`` of one of fate-edge's architectures.

llama.cpp names the architecture (``general.architecture``) and spells every hyperparameter
``{arch}.{key}``; this maps the MoE ones onto the ``model_type`` and keys ``fate_edge.model.arch`` reads, so a
converted GGUF is an ordinary store from there on. Layers without a router (``blk.N.ffn_gate_inp``) are dense.
"""

from __future__ import annotations

from typing import Any

from fate_edge.errors import ModelFormatError, UnsupportedArchitectureError
from fate_edge.format.gguf_reader import GGUFFile
from fate_edge.model.arch.limits import LIMITS, bounded_int

# general.architecture -> model_type (llama with experts is Mixtral; deepseek2 with sigmoid gating is V3)
ARCHITECTURES = {
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "llama": "mixtral",
    "mixtral": "mixtral",
    "olmoe": "olmoe",
    "deepseek2": "deepseek_v2",
    "gpt-oss": "gpt_oss",
    "lfm2moe": "lfm2_moe",
    "qwen3next": "qwen3_next",
    "qwen35moe": "qwen3_5_moe_text",
    "glm4moe": "glm4_moe",
    "ernie4_5-moe": "ernie4_5_moe",
    "minimax-m2": "minimax_m2",
}
_SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def model_type(g: GGUFFile) -> str:
    arch = g.architecture
    if arch not in ARCHITECTURES or (arch == "llama" and not g.arch_key("expert_count", 0)):
        what = "a dense llama model" if arch == "llama" else f"architecture '{arch}'"
        raise UnsupportedArchitectureError(
            f"{g.path}: general.architecture is {what}; fate-edge runs MoE models of the architectures "
            f"{', '.join(sorted(set(ARCHITECTURES) - {'mixtral'}))} (llama with experts: Mixtral)"
        )
    if arch == "deepseek2" and g.arch_key("expert_gating_func", 1) == _SIGMOID_GATING:
        return "deepseek_v3"
    return ARCHITECTURES[arch]


def dense_layers(g: GGUFFile, layers: int) -> list[int]:
    return [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in g.tensors]


def hf_config(g: GGUFFile, dtype: str) -> dict[str, Any]:
    """The ``config.json`` of the model in ``g``, its weights held in ``dtype`` ("bfloat16", "float32", ...)."""
    with g.metadata_read("the model's config"):
        return _hf_config(g, dtype)


def _hf_config(g: GGUFFile, dtype: str) -> dict[str, Any]:
    mtype = model_type(g)
    key = g.arch_key
    hidden = _count(g, "embedding_length", "hidden_size")
    layers = _count(g, "block_count", "num_hidden_layers")  # bounded before anything loops over it
    layers -= _mtp_layers(g, mtype, layers)
    heads = _count(g, "attention.head_count", "num_attention_heads")
    kv_heads = key("attention.head_count_kv", heads)
    per_layer_kv = kv_heads if isinstance(kv_heads, list) else None
    if isinstance(kv_heads, list):  # per-layer counts: fate-edge keeps one (0: a layer without attention, LFM2's)
        kv_heads = next((n for n in kv_heads if n), None)
    bounded_int(kv_heads, f"{g.path}: '{g.architecture}.attention.head_count_kv'", *LIMITS["num_key_value_heads"])
    vocab = _vocab(g)
    d: dict[str, Any] = {
        "model_type": mtype,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": key("feed_forward_length", 0) or key("expert_feed_forward_length"),
        "moe_intermediate_size": key("expert_feed_forward_length", None) or key("feed_forward_length"),
        "num_experts": _count(g, "expert_count", "num_experts"),
        "num_experts_per_tok": _count(g, "expert_used_count", "num_experts_per_tok"),
        "max_position_embeddings": key("context_length", 4096),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "torch_dtype": dtype,
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "bos_token_id": g.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": g.get("tokenizer.ggml.eos_token_id"),
    }
    if isinstance(d["intermediate_size"], list):
        d["intermediate_size"] = max(d["intermediate_size"])
    scaling = _rope_scaling(g)
    if scaling:
        d["rope_scaling"] = scaling
    head_dim = key("attention.key_length", None)
    dense = dense_layers(g, layers)
    norm = key("expert_weights_norm", None)
    if mtype in ("qwen2_moe", "qwen3_moe"):
        d.update(
            mlp_only_layers=dense,
            decoder_sparse_step=1,
            qkv_bias="blk.0.attn_q.bias" in g.tensors,
            shared_expert_intermediate_size=key("expert_shared_feed_forward_length", 0),
            norm_topk_prob=bool(norm if norm is not None else mtype == "qwen3_moe"),
        )
        if head_dim:
            d["head_dim"] = head_dim
    elif mtype == "mixtral":
        d["head_dim"] = head_dim or hidden // heads
    elif mtype == "lfm2_moe":
        d.update(_lfm2(g, layers, per_layer_kv))
    elif mtype in ("qwen3_next", "qwen3_5_moe_text"):
        d.update(_qwen3_next(g, layers, dense, head_dim or hidden // heads))
    elif mtype == "olmoe":
        d.update(norm_topk_prob=bool(norm or False), clip_qkv=key("attention.clamp_kqv", None))
    elif mtype == "gpt_oss":
        d.update(_gpt_oss(g, layers, head_dim))
    elif mtype in FAMILIES_2025:
        d.update(FAMILIES_2025[mtype](g, head_dim or hidden // heads, layers, dense))
        _check_dense(g, d, dense)
    else:
        d.update(_deepseek(g, dense))
    return d


def _mtp_layers(g: GGUFFile, mtype: str, block_count: int) -> int:
    """GLM-4.5's block_count counts its NextN (MTP) layers, written after the main ones: they are not run."""
    if mtype != "glm4_moe":
        return 0
    n = g.arch_key("nextn_predict_layers", 0)
    return bounded_int(n, f"{g.path}: '{g.architecture}.nextn_predict_layers'", 0, block_count - 1)


def _rotary(g: GGUFFile, head_dim: int) -> dict[str, Any]:
    """Partial rotary as transformers reads it: rope over the first ``rope.dimension_count`` of each head (llama.cpp's
    default where the key is absent: the whole head)."""
    rot = g.arch_key("rope.dimension_count", head_dim)
    if not isinstance(rot, int) or isinstance(rot, bool) or not 2 <= rot <= head_dim or rot % 2:
        raise ModelFormatError(
            f"{g.path}: metadata '{g.architecture}.rope.dimension_count' is {str(rot)[:40]}, not an even width in "
            f"2..{head_dim} (the head width); the GGUF is damaged (re-convert it with llama.cpp)"
        )
    return {"head_dim": head_dim, "partial_rotary_factor": rot / head_dim}


def _glm4_moe(g: GGUFFile, head_dim: int, layers: int, dense: list[int]) -> dict[str, Any]:
    key = g.arch_key
    return {
        **_rotary(g, head_dim),
        "attention_bias": "blk.0.attn_q.bias" in g.tensors,
        "use_qk_norm": "blk.0.attn_q_norm.weight" in g.tensors,
        "n_shared_experts": key("expert_shared_count", 0),
        "first_k_dense_replace": key("leading_dense_block_count", len(dense)),
        "routed_scaling_factor": float(key("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(key("expert_weights_norm", True)),
        "n_group": key("expert_group_count", 1),
        "topk_group": key("expert_group_used_count", 1),
        "num_nextn_predict_layers": 0,  # the store holds the main layers only
    }


def _ernie4_5_moe(g: GGUFFile, head_dim: int, layers: int, dense: list[int]) -> dict[str, Any]:
    key = g.arch_key
    moe = [i for i in range(layers) if i not in dense]
    return {
        "head_dim": head_dim,
        "moe_num_shared_experts": key("expert_shared_count", 0),
        "moe_layer_start_index": key("leading_dense_block_count", moe[0] if moe else layers),
        "moe_layer_interval": key("interleave_moe_layer_step", 1),
        "moe_layer_end_index": moe[-1] if moe else -1,  # not in the metadata: the last layer with a router
        "use_bias": False,
    }


def _minimax_m2(g: GGUFFile, head_dim: int, layers: int, dense: list[int]) -> dict[str, Any]:
    key = g.arch_key
    return {
        **_rotary(g, head_dim),
        "intermediate_size": key("expert_feed_forward_length"),  # every MLP is routed
        "use_qk_norm": True,
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
        "routed_scaling_factor": float(key("expert_weights_scale", 1.0)),
    }


FAMILIES_2025 = {"glm4_moe": _glm4_moe, "ernie4_5_moe": _ernie4_5_moe, "minimax_m2": _minimax_m2}
_DENSE_KEYS = {
    "glm4_moe": ("leading_dense_block_count",),
    "ernie4_5_moe": ("leading_dense_block_count", "interleave_moe_layer_step"),
}


def _check_dense(g: GGUFFile, d: dict[str, Any], dense: list[int]) -> None:
    """The dense layers the metadata implies are the layers without a router (else the forward would look for
    experts that are not there, or skip some that are)."""
    from fate_edge.model.arch import config_from_dict

    said = list(config_from_dict(d, str(g.path)).dense_layers)
    if said != dense:
        what = " / ".join(f"'{g.architecture}.{k}'" for k in _DENSE_KEYS.get(d["model_type"], ("block_count",)))
        raise ModelFormatError(
            f"{g.path}: metadata {what} makes layers {said[:8]} dense but layers {dense[:8]} have "
            "no router (blk.N.ffn_gate_inp); the GGUF's metadata does not match its tensors (re-convert it)"
        )


def _count(g: GGUFFile, suffix: str, hf_key: str) -> int:
    """``{arch}.{suffix}``, required, within the bounds of the config key it becomes."""
    return bounded_int(g.arch_key(suffix), f"{g.path}: '{g.architecture}.{suffix}'", *LIMITS[hf_key])


def _vocab(g: GGUFFile) -> int:
    """The vocabulary: the token list's length, which the embedding table must cover."""
    rows = g.info("token_embd.weight").shape[0]
    tokens = g.get("tokenizer.ggml.tokens")
    if tokens is None:
        return rows
    if not isinstance(tokens, list) or not tokens:
        raise ModelFormatError(
            f"{g.path}: tokenizer.ggml.tokens is {'empty' if tokens == [] else 'not a list'}; the GGUF has no "
            "usable vocabulary (re-convert it with llama.cpp)"
        )
    if len(tokens) > rows:
        raise ModelFormatError(
            f"{g.path}: {len(tokens)} tokens but token_embd.weight has {rows} rows; the GGUF is damaged"
        )
    return len(tokens)


def _rope_scaling(g: GGUFFile) -> dict[str, Any] | None:
    kind = g.arch_key("rope.scaling.type", None)
    if kind in (None, "none"):
        return None
    out: dict[str, Any] = {"rope_type": kind, "factor": float(g.arch_key("rope.scaling.factor", 1.0))}
    original = g.arch_key("rope.scaling.original_context_length", None)
    if original:
        out["original_max_position_embeddings"] = original
    if kind == "yarn":
        for name in ("beta_fast", "beta_slow"):  # llama.cpp's converter writes them where the config has them
            value = g.arch_key(f"rope.scaling.yarn_{name}", None)
            if value is not None:
                out[name] = float(value)
        log_mul = g.arch_key("rope.scaling.yarn_log_multiplier", None)
        if log_mul:  # DeepSeek: llama.cpp stores 0.1 * mscale_all_dim
            out["mscale_all_dim"] = float(log_mul) / 0.1
            out["mscale"] = out["mscale_all_dim"]
    return out


def _gpt_oss(g: GGUFFile, layers: int, head_dim: int | None) -> dict[str, Any]:
    """gpt-oss: llama.cpp sets its sliding-window pattern to 2 (even layers slide, as transformers' default
    ``layer_types``) and computes the clamped SwiGLU at 7.0 and 1.702 (not stored); YaRN without truncation."""
    key = g.arch_key
    out: dict[str, Any] = {
        "intermediate_size": key("expert_feed_forward_length"),
        "sliding_window": key("attention.sliding_window"),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "attention_bias": True,
        "swiglu_limit": 7.0,
        "swiglu_alpha": 1.702,
    }
    if head_dim:
        out["head_dim"] = head_dim
    scaling = _rope_scaling(g)
    if scaling:
        out["rope_scaling"] = {**scaling, "truncate": False}
    return out


def _deepseek(g: GGUFFile, dense: list[int]) -> dict[str, Any]:
    key = g.arch_key
    rope_dim = key("rope.dimension_count")
    kv_rank = key("attention.kv_lora_rank")
    q_rank = key("attention.q_lora_rank", 0) or None
    if key("attention.key_length_mla", None):  # newer converters: key_length is the absorbed (latent) width
        qk_head, v_head = key("attention.key_length_mla"), key("attention.value_length_mla")
    else:
        qk_head, v_head = key("attention.key_length"), key("attention.value_length")
    gating = key("expert_gating_func", 1)
    return {
        "q_lora_rank": q_rank,
        "kv_lora_rank": kv_rank,
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": qk_head - rope_dim,
        "v_head_dim": v_head,
        "first_k_dense_replace": key("leading_dense_block_count", len(dense)),
        "n_shared_experts": key("expert_shared_count", 0),
        "routed_scaling_factor": float(key("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(key("expert_weights_norm", gating == _SIGMOID_GATING)),
        "n_group": key("expert_group_count", 1),
        "topk_group": key("expert_group_used_count", 1),
        "topk_method": "group_limited_greedy" if key("expert_group_count", 1) > 1 else "greedy",
        "rope_interleave": True,
    }


def _lfm2(g: GGUFFile, layers: int, per_layer_kv: list | None) -> dict[str, Any]:
    """LFM2-MoE: its convolution layers are those llama.cpp gives no key/value heads; every MoE layer routes on
    sigmoid scores plus the expert bias, renormalised (llama.cpp always renormalises this family)."""
    key = g.arch_key
    kv = per_layer_kv if per_layer_kv is not None and len(per_layer_kv) == layers else [1] * layers
    return {
        "layer_types": ["full_attention" if n else "conv" for n in kv],
        "conv_L_cache": key("shortconv.l_cache"),
        "num_dense_layers": key("leading_dense_block_count", 0),
        "norm_topk_prob": True,
        "routed_scaling_factor": float(key("expert_weights_scale", 0.0) or 1.0),
        "use_expert_bias": True,
    }


def _qwen3_next(g: GGUFFile, layers: int, dense: list[int], head_dim: int) -> dict[str, Any]:
    """Qwen3-Next: its DeltaNet layers from ``attention.recurrent_layers`` (or every ``full_attention_interval``-th
    layer attention), their widths from the ``ssm.*`` keys, rope over ``rope.dimension_count`` of each head."""
    key = g.arch_key
    recurrent = key("attention.recurrent_layers", None)
    if not isinstance(recurrent, list) or len(recurrent) < layers:
        every = key("full_attention_interval", 4)
        recurrent = [bool((i + 1) % every) for i in range(layers)]
    value_heads = key("ssm.time_step_rank")
    layers -= key("nextn_predict_layers", 0) or 0  # multi-token-prediction blocks past the model's own: not run
    return {
        "num_hidden_layers": layers,
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent[:layers]],
        "head_dim": head_dim,
        "partial_rotary_factor": key("rope.dimension_count", head_dim) / head_dim,
        "linear_conv_kernel_dim": key("ssm.conv_kernel"),
        "linear_num_key_heads": key("ssm.group_count"),
        "linear_key_head_dim": key("ssm.state_size"),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": key("ssm.inner_size") // value_heads,
        "mlp_only_layers": [i for i in dense if i < layers],
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": key("expert_shared_feed_forward_length", 0),
        "norm_topk_prob": bool(key("expert_weights_norm", True)),
    }
