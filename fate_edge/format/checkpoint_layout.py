"""How a Hugging Face MoE checkpoint is laid out: each layer's module prefixes, the tensors a forward pass reads,
resident weights apart from routed experts, and the dtypes by name."""

from __future__ import annotations

import torch

from fate_edge.errors import MissingTensorError
from fate_edge.format.checkpoint import CheckpointReader
from fate_edge.model.arch import ModelConfig
from fate_edge.model.layer import delta_projections
from fate_edge.model.transformer import LayerNames

# Router weights and DeepSeek's correction bias stay in fp32, as the reference keeps them.
# gpt-oss's router (weight and bias) is ``mlp.router``.
FP32_SUFFIXES = (".gate.weight", ".e_score_correction_bias", ".mlp.router.weight", ".mlp.router.bias")

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


# The module holding each kind of token mixer (ModelConfig.mixer)
_MIXER_MODULE = {"attention": "self_attn", "conv": "conv", "linear_attention": "linear_attn"}
# A recurrent mixer's tensors (fate_edge.model.recurrent), by kind
_MIXER_TENSORS = {
    "conv": ["in_proj.weight", "out_proj.weight", "conv.weight"],
    "linear_attention": ["out_proj.weight", "conv1d.weight", "dt_bias", "A_log", "norm.weight"],
}


# Parts of a checkpoint the text model never reads: a multimodal model's vision tower, multi-token-prediction heads
NOT_READ = ("model.visual.", "mtp.")


def is_routed_expert_tensor(name: str) -> bool:
    return ".experts." in name


def layer_names(config: ModelConfig, reader: CheckpointReader) -> list[LayerNames]:
    names = []
    for i in range(config.num_hidden_layers):
        base = f"model.layers.{i}"
        mlp = f"{base}.mlp"
        router = ""
        if config.is_moe_layer(i) and f"{mlp}.gate.weight" not in reader:
            if f"{base}.block_sparse_moe.gate.weight" in reader:  # Mixtral's original naming
                mlp = f"{base}.block_sparse_moe"
            elif f"{mlp}.router.weight" in reader:  # gpt-oss
                router = f"{mlp}.router"
            else:
                raise MissingTensorError(
                    f"{reader.model_dir}: tensor '{mlp}.gate.weight' (layer {i}'s router) not found; "
                    "the checkpoint is incomplete or does not match config.json"
                )
        attn = f"{base}.{_MIXER_MODULE[config.mixer(i)]}"
        norms = (f"{base}.input_layernorm", f"{base}.post_attention_layernorm")
        names.append(LayerNames(attn, mlp, *norms, router=router))
    return names


def required_tensors(config: ModelConfig, names: list[LayerNames]) -> list[str]:
    """Weights the forward pass will read, checked up front so a missing one is reported by name at load."""
    req = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        req.append("lm_head.weight")
    for i, n in enumerate(names):
        proj = ["o_proj"]
        if config.mixer(i) != "attention":
            req += [f"{n.attn}.{t}" for t in _MIXER_TENSORS[config.mixer(i)]]
            if config.mixer(i) == "linear_attention":
                req += [f"{n.attn}.{p}.weight" for group in delta_projections(config).values() for p in group]
            proj = []
        elif config.mla is None:
            proj += ["q_proj", "k_proj", "v_proj"] + (["q_norm", "k_norm"] if config.qk_norm != "none" else [])
        else:
            proj += ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj"]
            proj += ["q_proj"] if config.mla.q_lora_rank is None else ["q_a_proj", "q_a_layernorm", "q_b_proj"]
        req += [f"{n.attn}.{p}.weight" for p in proj] + [f"{n.input_norm}.weight", f"{n.post_attn_norm}.weight"]
        if config.attention_sinks:
            req.append(f"{n.attn}.sinks")
        dense = [] if config.is_moe_layer(i) else [n.mlp]
        if config.is_moe_layer(i) and config.shared_expert_intermediate_size:
            dense.append(f"{n.mlp}.shared_expert" if config.shared_expert_gated else f"{n.mlp}.shared_experts")
            if config.shared_expert_gated:
                req.append(f"{n.mlp}.shared_expert_gate.weight")
        req += [f"{d}.{p}.weight" for d in dense for p in ("gate_proj", "up_proj", "down_proj")]
    return req


def resident_weight_names(config: ModelConfig, reader: CheckpointReader) -> list[str]:
    """Everything that is not a routed expert, for layers the model actually has (DeepSeek ships extra MTP layers)."""
    out = []
    for name in reader.keys():
        if is_routed_expert_tensor(name):
            continue
        if name.startswith(NOT_READ):
            continue
        if name.startswith("model.layers."):
            if int(name.split(".")[2]) >= config.num_hidden_layers:
                continue
        out.append(name)
    return out
