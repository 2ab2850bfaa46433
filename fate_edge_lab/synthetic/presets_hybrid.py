"""Presets of gpt-oss-20b and LFM2-8B-A1B: their published config.json key for key (as in ``presets``, where
Qwen3-Next-80B-A3B is, derived from Qwen3-30B-A3B), with what each leaves out said in its ``source``."""

from __future__ import annotations

from fate_edge_lab.synthetic.preset_types import CHATML, Preset

HARMONY_CHAT = (
    "{% for m in messages %}{{ '<|start|>' + m['role'] + '<|message|>' + m['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}"
)

GPT_OSS_20B = Preset(
    name="gpt-oss-20b",
    source="https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json (model card: 21B params, 3.6B active; "
    "OpenAI's gpt-oss model card: 20.91B total). quantization_config (MXFP4 experts) left out: the float layout",
    config={
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "eos_token_id": 200002,
        "experts_per_token": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2880,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": 64,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 24,
        "num_key_value_heads": 8,
        "num_local_experts": 32,
        "pad_token_id": 199999,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 201088,
    },
    special_tokens={
        "<|startoftext|>": 199998,
        "<|endoftext|>": 199999,
        "<|return|>": 200002,
        "<|constrain|>": 200003,
        "<|channel|>": 200005,
        "<|start|>": 200006,
        "<|end|>": 200007,
        "<|message|>": 200008,
        "<|call|>": 200012,
    },
    tokenizer_config={
        "bos_token": "<|startoftext|>",
        "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
    },
    generation_config={"bos_token_id": 199998, "eos_token_id": [200002, 199999, 200012], "pad_token_id": 199999},
    chat_template=HARMONY_CHAT,
    published_params=20.91e9,
)

LFM2_FULL_ATTENTION = (2, 6, 10, 14, 18, 21)  # the other 18 of the 24 layers are short-convolution blocks

LFM2_8B_A1B = Preset(
    name="lfm2-8b-a1b",
    source="https://huggingface.co/LiquidAI/LFM2-8B-A1B/blob/main/config.json (model card: 8.3B params, 1.5B active)",
    config={
        "architectures": ["Lfm2MoeForCausalLM"],
        "bos_token_id": 1,
        "conv_L_cache": 3,
        "conv_bias": False,
        "eos_token_id": 7,
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 7168,
        "layer_types": ["full_attention" if i in LFM2_FULL_ATTENTION else "conv" for i in range(24)],
        "max_position_embeddings": 128000,
        "model_type": "lfm2_moe",
        "moe_intermediate_size": 1792,
        "norm_eps": 1e-05,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_dense_layers": 2,
        "num_experts": 32,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 24,
        "num_key_value_heads": 8,
        "pad_token_id": 0,
        "rope_theta": 1000000.0,
        "routed_scaling_factor": 1.0,
        "tie_embedding": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_expert_bias": True,
        "vocab_size": 65536,
    },
    special_tokens={"<|pad|>": 0, "<|startoftext|>": 1, "<|endoftext|>": 2, "<|im_start|>": 6, "<|im_end|>": 7},
    tokenizer_config={
        "bos_token": "<|startoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|pad|>",
        "add_bos_token": True,
    },
    generation_config={"bos_token_id": 1, "eos_token_id": 7, "pad_token_id": 0},
    chat_template="{{ bos_token }}" + CHATML,
    published_params=8.3e9,
)
