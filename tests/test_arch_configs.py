"""Config parsing of the newer families: the defaults their transformers classes apply when a key is absent."""

from fate_edge.model.arch import config_from_dict

GLM = dict(
    model_type="glm4_moe",
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=96,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=2,
)


def test_glm4_moe_rotates_half_of_each_head_unless_told_otherwise():
    assert config_from_dict(dict(GLM)).rope.partial_rotary_factor == 0.5
    told = {**GLM, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 1.0}}
    assert config_from_dict(told).rope.partial_rotary_factor == 1.0


def test_glm4_moe_defaults_one_dense_layer_and_ungated_shared_experts():
    cfg = config_from_dict(dict(GLM))
    assert cfg.dense_layers == (0,) and cfg.moe_layers == [1, 2]
    assert cfg.shared_expert_intermediate_size == 64 and not cfg.shared_expert_gated
    assert cfg.router == "deepseek_v3" and cfg.norm_topk_prob


def test_minimax_m2_routes_every_layer_with_one_expert_width():
    cfg = config_from_dict(
        dict(
            model_type="minimax_m2",
            vocab_size=128,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
        )
    )
    assert cfg.moe_layers == [0, 1] and cfg.moe_intermediate_size == 32 and cfg.qk_norm == "full"
