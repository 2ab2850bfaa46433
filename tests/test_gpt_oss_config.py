"""gpt-oss's config.json: the published 20b config parsed to what transformers builds from it, and its new keys
(``layer_types``, ``swiglu_limit``, ``swiglu_alpha``) checked, each bad value one error naming it."""

import pytest

from fate_edge.errors import ModelFormatError
from fate_edge.model.arch import config_from_dict

# openai/gpt-oss-20b's config.json (its MXFP4 quantization_config left out)
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
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
    "output_router_logits": False,
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
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": 201088,
}


def test_the_published_20b_config():
    cfg = config_from_dict(dict(GPT_OSS_20B))
    assert cfg.sliding_window == 128 and cfg.sliding_window_layers == tuple(range(0, 24, 2))
    assert cfg.attention_sinks and cfg.attention_bias and cfg.o_proj_bias
    assert cfg.router == "topk_softmax" and cfg.moe_layers == list(range(24)) and cfg.num_experts == 32
    assert cfg.expert_bias and cfg.experts_interleaved and cfg.swiglu_limit == 7.0 and cfg.swiglu_alpha == 1.702
    assert cfg.moe_intermediate_size == 2880 and cfg.head_dim == 64 and cfg.eos_token_ids == (200002,)
    assert cfg.expert_params == 3 * 2880 * 2880 + 2 * 2880 + 2880  # the matrices and their biases
    r = cfg.rope
    assert (r.rope_type, r.factor, r.theta, r.original_max_position_embeddings) == ("yarn", 32.0, 150000.0, 4096)
    assert r.truncate is False and r.beta_fast == 32.0 and r.beta_slow == 1.0


def test_without_layer_types_or_rope_transformers_defaults_apply():
    d = {k: v for k, v in GPT_OSS_20B.items() if k not in ("layer_types", "rope_scaling", "rope_theta")}
    cfg = config_from_dict(d)
    assert cfg.sliding_window_layers == tuple(range(0, 24, 2))  # sliding first, then alternating
    assert (cfg.rope.rope_type, cfg.rope.factor, cfg.rope.theta, cfg.rope.truncate) == ("yarn", 32.0, 150000.0, False)


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("layer_types", ["sliding_attention"] * 23, "'layer_types' is"),
        ("layer_types", "sliding_attention", "'layer_types' is"),
        ("layer_types", ["sliding_attention"] * 23 + ["chunked_attention"], "'layer_types'[23]"),
        ("swiglu_limit", -7.0, "'swiglu_limit'"),
        ("swiglu_limit", "7", "'swiglu_limit'"),
        ("swiglu_alpha", float("nan"), "'swiglu_alpha'"),
        ("sliding_window", -1, "'sliding_window'"),
    ],
)
def test_a_bad_value_is_one_error_naming_its_key(key, value, named):
    with pytest.raises(ModelFormatError) as err:
        config_from_dict({**GPT_OSS_20B, key: value})
    assert named in str(err.value) and "\n" not in str(err.value)
