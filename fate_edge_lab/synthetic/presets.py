"""Published configurations of the MoE checkpoints users run, for synthetic checkpoints of the same shape.

Each ``config`` is the model's ``config.json`` on the Hugging Face hub (URL in ``source``), key for key,
except ``auto_map`` / ``architectures`` pointers to remote code and training-only keys (dropout, aux-loss
coefficients, ``output_router_logits``), which change no shape and no inference result. The special
tokens and generation settings come from the same repositories' ``tokenizer_config.json`` and
``generation_config.json``. The chat templates are short equivalents of the published ones.
"""

from __future__ import annotations

from dataclasses import replace

from fate_edge_lab.synthetic.preset_types import _QWEN_SPECIALS, CHATML, Preset
from fate_edge_lab.synthetic.presets_hybrid import GPT_OSS_20B, LFM2_8B_A1B

__all__ = ["CHATML", "PRESETS", "Preset", "get_preset"]

INST = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"
)
DEEPSEEK = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ 'User: ' + m['content'] + '\\n\\n' }}"
    "{% elif m['role'] == 'assistant' %}{{ 'Assistant: ' + m['content'] + eos_token }}"
    "{% else %}{{ m['content'] + '\\n\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
TULU = (
    "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


QWEN15_MOE_A27B = Preset(
    name="qwen1.5-moe-a2.7b",
    source="https://huggingface.co/Qwen/Qwen1.5-MoE-A2.7B/blob/main/config.json (model card: 14.3B params, "
    "2.7B active)",
    config={
        "architectures": ["Qwen2MoeForCausalLM"],
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 5632,
        "max_position_embeddings": 8192,
        "max_window_layers": 21,
        "model_type": "qwen2_moe",
        "moe_intermediate_size": 1408,
        "norm_topk_prob": False,
        "num_attention_heads": 16,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 24,
        "num_key_value_heads": 16,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "shared_expert_intermediate_size": 5632,
        "sliding_window": 32768,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    special_tokens=_QWEN_SPECIALS,
    tokenizer_config={
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
    },
    generation_config={"bos_token_id": 151643, "eos_token_id": 151643, "do_sample": False, "max_new_tokens": 2048},
    chat_template=CHATML,
    published_params=14.3e9,
)

OLMOE_1B_7B = Preset(
    name="olmoe-1b-7b",
    source="https://huggingface.co/allenai/OLMoE-1B-7B-0924/blob/main/config.json (model card: 6.9B params, "
    "1.3B active)",
    config={
        "architectures": ["OlmoeForCausalLM"],
        "attention_bias": False,
        "bos_token_id": None,
        "clip_qkv": None,
        "eos_token_id": 50279,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 1024,
        "max_position_embeddings": 4096,
        "model_type": "olmoe",
        "norm_topk_prob": False,
        "num_attention_heads": 16,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 16,
        "num_key_value_heads": 16,
        "pad_token_id": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 50304,
    },
    special_tokens={"<|padding|>": 1, "<|endoftext|>": 50279},
    tokenizer_config={
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|padding|>",
        "add_bos_token": False,
    },
    generation_config={"eos_token_id": 50279, "pad_token_id": 1},
    chat_template=TULU,
    published_params=6.9e9,
)

DEEPSEEK_V2_LITE = Preset(
    name="deepseek-v2-lite",
    source="https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite/blob/main/config.json (model card: 15.7B params, "
    "2.4B active)",
    config={
        "architectures": ["DeepseekV2ForCausalLM"],
        "attention_bias": False,
        "bos_token_id": 100000,
        "eos_token_id": 100001,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 10944,
        "kv_lora_rank": 512,
        "max_position_embeddings": 163840,
        "model_type": "deepseek_v2",
        "moe_intermediate_size": 1408,
        "moe_layer_freq": 1,
        "n_group": 1,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "norm_topk_prob": False,
        "num_attention_heads": 16,
        "num_experts_per_tok": 6,
        "num_hidden_layers": 27,
        "num_key_value_heads": 16,
        "q_lora_rank": None,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 1.0,
        "scoring_func": "softmax",
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "greedy",
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "v_head_dim": 128,
        "vocab_size": 102400,
    },
    special_tokens={"<｜begin▁of▁sentence｜>": 100000, "<｜end▁of▁sentence｜>": 100001},
    tokenizer_config={
        "bos_token": "<｜begin▁of▁sentence｜>",
        "eos_token": "<｜end▁of▁sentence｜>",
        "pad_token": "<｜end▁of▁sentence｜>",
        "add_bos_token": True,
    },
    generation_config={
        "bos_token_id": 100000,
        "eos_token_id": 100001,
        "do_sample": True,
        "temperature": 0.3,
        "top_p": 0.95,
    },
    chat_template=DEEPSEEK,
    published_params=15.7e9,
)

QWEN3_30B_A3B = Preset(
    name="qwen3-30b-a3b",
    source="https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json (model card: 30.5B params, 3.3B active)",
    config={
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "max_position_embeddings": 40960,
        "max_window_layers": 48,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    special_tokens=_QWEN_SPECIALS,
    tokenizer_config={
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
    },
    generation_config={
        "bos_token_id": 151643,
        "eos_token_id": [151645, 151643],
        "pad_token_id": 151643,
        "do_sample": True,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    },
    chat_template=CHATML,
    published_params=30.5e9,
)

# Qwen3-Next: Qwen3-30B-A3B's config but for its hybrid layers and sizes (no sliding-window keys), the same tokenizer,
# special tokens and chat format
QWEN3_NEXT_80B_A3B = replace(
    QWEN3_30B_A3B,
    name="qwen3-next-80b-a3b",
    source="https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/config.json (model card: 80B params, "
    "3B active; the checkpoint's MTP weights, mtp.*, are not written)",
    config={
        **{k: v for k, v in QWEN3_30B_A3B.config.items() if k not in ("max_window_layers", "sliding_window")},
        "architectures": ["Qwen3NextForCausalLM"],
        "full_attention_interval": 4,
        "head_dim": 256,
        "intermediate_size": 5120,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "model_type": "qwen3_next",
        "moe_intermediate_size": 512,
        "num_attention_heads": 16,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "num_key_value_heads": 2,
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000,
        "shared_expert_intermediate_size": 512,
    },
    generation_config={
        **{k: v for k, v in QWEN3_30B_A3B.generation_config.items() if k != "do_sample"},
        "temperature": 0.7,
        "top_p": 0.8,
    },
    published_params=80e9,
)

MIXTRAL_8X7B = Preset(
    name="mixtral-8x7b",
    source="https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json (model card: 46.7B params, "
    "12.9B active)",
    config={
        "architectures": ["MixtralForCausalLM"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "model_type": "mixtral",
        "num_attention_heads": 32,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 32000,
    },
    special_tokens={"<unk>": 0, "<s>": 1, "</s>": 2},
    tokenizer_config={"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True},
    generation_config={"bos_token_id": 1, "eos_token_id": 2},
    chat_template=INST,
    published_params=46.7e9,
)

GLM_CHAT = (
    "[gMASK]<sop>{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
ERNIE_CHAT = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ 'User: ' + m['content'] + '\\n' }}"
    "{% elif m['role'] == 'assistant' %}{{ 'Assistant: ' + m['content'] + eos_token }}"
    "{% else %}{{ m['content'] + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}"
)
MINIMAX_CHAT = (
    "{% for m in messages %}{{ ']~b]' + m['role'] + '\\n' + m['content'] + '[e~[\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ ']~b]ai\\n' }}{% endif %}"
)

GLM45_AIR = Preset(
    name="glm-4.5-air",
    source="https://huggingface.co/zai-org/GLM-4.5-Air/blob/main/config.json (model card: 106B params, 12B "
    "active; one MTP layer past num_hidden_layers)",
    config={
        "architectures": ["Glm4MoeForCausalLM"],
        "attention_bias": True,
        "eos_token_id": [151329, 151336, 151338],
        "first_k_dense_replace": 1,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 10944,
        "max_position_embeddings": 131072,
        "model_type": "glm4_moe",
        "moe_intermediate_size": 1408,
        "n_group": 1,
        "n_routed_experts": 128,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 96,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 46,
        "num_key_value_heads": 8,
        "num_nextn_predict_layers": 1,
        "pad_token_id": 151329,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "routed_scaling_factor": 1.0,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_qk_norm": False,
        "vocab_size": 151552,
    },
    special_tokens={
        "<|endoftext|>": 151329,
        "[MASK]": 151330,
        "[gMASK]": 151331,
        "[sMASK]": 151332,
        "<sop>": 151333,
        "<eop>": 151334,
        "<|system|>": 151335,
        "<|user|>": 151336,
        "<|assistant|>": 151337,
        "<|observation|>": 151338,
    },
    tokenizer_config={"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "add_bos_token": False},
    generation_config={"eos_token_id": [151329, 151336, 151338], "pad_token_id": 151329, "temperature": 0.6},
    chat_template=GLM_CHAT,
    published_params=106e9,
)

ERNIE45_21B_A3B = Preset(
    name="ernie-4.5-21b-a3b",
    source="https://huggingface.co/baidu/ERNIE-4.5-21B-A3B-PT/blob/main/config.json (model card: 21B params, "
    "3B active)",
    config={
        "architectures": ["Ernie4_5_MoeForCausalLM"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2560,
        "intermediate_size": 12288,
        "max_position_embeddings": 131072,
        "model_type": "ernie4_5_moe",
        "moe_intermediate_size": 1536,
        "moe_k": 6,
        "moe_layer_end_index": 27,
        "moe_layer_interval": 1,
        "moe_layer_start_index": 1,
        "moe_num_experts": 64,
        "moe_num_shared_experts": 2,
        "num_attention_heads": 20,
        "num_hidden_layers": 28,
        "num_key_value_heads": 4,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_bias": False,
        "use_cache": False,
        "vocab_size": 103424,
    },
    special_tokens={"<unk>": 0, "<s>": 1, "</s>": 2},
    tokenizer_config={"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": False},
    generation_config={"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "top_p": 0.8, "temperature": 0.8},
    chat_template=ERNIE_CHAT,
    published_params=21e9,
)

MINIMAX_M2 = Preset(
    name="minimax-m2",
    source="https://huggingface.co/MiniMaxAI/MiniMax-M2/blob/main/config.json (model card: 230B params, 10B "
    "active; the MTP keys describe modules the released weights do not hold)",
    config={
        "architectures": ["MiniMaxM2ForCausalLM"],
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 3072,
        "intermediate_size": 1536,
        "max_position_embeddings": 196608,
        "model_type": "minimax_m2",
        "num_attention_heads": 48,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 62,
        "num_key_value_heads": 8,
        "num_local_experts": 256,
        "qk_norm_type": "per_layer",
        "rms_norm_eps": 1e-06,
        "rope_theta": 5000000,
        "rotary_dim": 64,
        "scoring_func": "sigmoid",
        "shared_intermediate_size": 0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_qk_norm": True,
        "use_routing_bias": True,
        "vocab_size": 200064,
    },
    special_tokens={"]~!b[": 200019, "[e~[": 200020},
    tokenizer_config={"bos_token": "]~!b[", "eos_token": "[e~[", "add_bos_token": False},
    generation_config={"bos_token_id": 200019, "eos_token_id": 200020, "temperature": 1.0, "top_p": 0.95},
    chat_template=MINIMAX_CHAT,
    published_params=230e9,
)
PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        QWEN15_MOE_A27B,
        OLMOE_1B_7B,
        DEEPSEEK_V2_LITE,
        QWEN3_30B_A3B,
        MIXTRAL_8X7B,
        GLM45_AIR,
        ERNIE45_21B_A3B,
        MINIMAX_M2,
        GPT_OSS_20B,
        QWEN3_NEXT_80B_A3B,
        LFM2_8B_A1B,
    )
}


def get_preset(name: str) -> Preset:
    key = name.lower()
    if key not in PRESETS:
        raise KeyError(f"unknown --like '{name}'; choose one of: {', '.join(PRESETS)}")
    return PRESETS[key]
