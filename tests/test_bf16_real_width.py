"""bf16 parity at Qwen1.5-MoE-A2.7B's real widths (hidden 2048, expert 1408, shared expert 5632, 16 heads).

At this width transformers' own bf16 forward is ~2-3e-2 from its float32 forward (measured on a 2-layer synthetic
Qwen1.5-MoE checkpoint: 0.026 on 128 tokens of text), so the absolute 2e-2 of DESIGN.md between two bf16
implementations, each rounding differently, cannot hold there. What must hold is DESIGN's relative bar: our
bf16 logits are no further from the exact (float32) logits than transformers' bf16 logits are.
"""

import pytest
import torch
from _tiny_moe import build_tokenizer

from fate_edge import load_model

transformers = pytest.importorskip("transformers")
BF16_ATOL = 2e-2  # tests/test_parity.py, DESIGN.md §3


@pytest.fixture(scope="module")
def real_width(tmp_path_factory):
    """One MoE layer at the published widths (4 experts, top-2, a small vocabulary), saved in bf16."""
    cfg = transformers.Qwen2MoeConfig(
        vocab_size=512,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=1,
        num_attention_heads=16,
        num_key_value_heads=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632,
        norm_topk_prob=False,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        rope_theta=1e6,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2MoeForCausalLM(cfg).to(torch.bfloat16)
    out = tmp_path_factory.mktemp("real-width")
    model.save_pretrained(out)
    build_tokenizer(out)
    return out


def _hf_last(path, dtype, ids):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()
    with torch.no_grad():
        return hf(ids).logits[0, -1].float()


@pytest.mark.slow
def test_bf16_at_real_width_is_as_close_to_exact_as_transformers_bf16(real_width):
    ids = torch.randint(1, 512, (1, 48), generator=torch.Generator().manual_seed(1))
    exact = _hf_last(real_width, torch.float32, ids)  # the bf16 weights, computed in float32
    theirs = _hf_last(real_width, torch.bfloat16, ids)
    model = load_model(real_width, dtype=torch.bfloat16)
    with torch.no_grad():
        ours = model(ids, model.new_cache(), last_only=True)[0, -1].float()
        fp32 = load_model(real_width, dtype=torch.float32)
        assert (fp32(ids, fp32.new_cache(), last_only=True)[0, -1] - exact).abs().max() <= 1e-4
    ours_err, their_err = (ours - exact).abs().max().item(), (theirs - exact).abs().max().item()
    print(
        f"bf16 vs float32: ours {ours_err:.4f}, transformers {their_err:.4f}; ours vs transformers "
        f"{(ours - theirs).abs().max().item():.4f}"
    )
    assert ours_err <= max(BF16_ATOL, 1.25 * their_err)
