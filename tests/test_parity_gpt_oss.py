"""gpt-oss (``gpt_oss``) against transformers on a tiny random checkpoint: attention sinks, sliding-window layers
alternating with full ones (the window shorter than the prompt, decode steps past it), q/k/v/o biases, YaRN rope, a
router with a bias, experts with biases and the clamped SwiGLU (the limit low enough to clamp).

transformers writes one float layout for gpt-oss (``save_pretrained``: ``mlp.experts.gate_up_proj`` [E, H, 2I] with
gate and up in alternating columns, biases beside); the published checkpoints' other layout is MXFP4 blocks and
scales (its format and kernel are tested with it). The helpers come from tests/test_parity.py.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from _parity import batched_with_a_joiner, one_quiet_thread  # noqa: E402
from test_parity import NEW_TOKENS, _alone, max_diff, our_greedy, record_routing  # noqa: E402

from fate_edge.model.attention import attend, sink_attention  # noqa: E402
from fate_edge.model.experts import ExpertWeights, Glu  # noqa: E402
from fate_edge.model.kv_cache import Held  # noqa: E402
from fate_edge.model.rope import RotaryEmbedding  # noqa: E402
from fate_edge.runtime.loader import load_model  # noqa: E402

FP32_ATOL = 1e-4
WINDOW = 5
PROMPT_LEN = 12  # > WINDOW: the sliding layers see part of the prompt; decode runs to 28 positions
CONFIG = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=3,  # sliding, full, sliding (transformers' default layer_types)
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=32,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=128,
    initializer_range=0.1,
    sliding_window=WINDOW,
    swiglu_limit=1.0,  # gates and ups reach past 1 here: the clamp bites (test_variant_is_exercised)
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=False,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=150000.0,
        factor=4.0,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_max_position_embeddings=32,
    ),
)


def build(out: Path, **changes) -> tuple[torch.nn.Module, Path]:
    """A seeded random gpt-oss saved by transformers, its biases and sinks random too (they start at zero)."""
    config = transformers.GptOssConfig(**{**CONFIG, **changes})
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.copy_(torch.randn_like(p) * 0.5)
    hf.save_pretrained(out)
    return hf, out


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_quiet_thread():
        yield


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    hf, path = build(tmp_path_factory.mktemp("gpt_oss") / "hf")
    prompt = torch.randint(0, 128, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(1234))
    with torch.no_grad():
        prefill = hf(prompt).logits
        out = hf.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            eos_token_id=None,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_logits=True,
        )
    tokens = out.sequences[0, PROMPT_LEN:].tolist()
    return dict(hf=hf, path=path, prompt=prompt, prefill=prefill, tokens=tokens, steps=[g[0] for g in out.logits])


def test_logits_and_greedy_match_transformers(built):
    model = load_model(built["path"], dtype=torch.float32)
    cfg = model.config
    assert cfg.sliding_window_layers == (0, 2) and cfg.sliding_window == WINDOW and cfg.attention_sinks
    routing = record_routing(model)
    logits = model(built["prompt"], model.new_cache())
    assert max_diff(logits, built["prefill"]) <= FP32_ATOL
    for layer, idx in routing:
        assert idx.unique().numel() > cfg.num_experts_per_tok, f"layer {layer}: every token picked the same experts"
    tokens, steps = our_greedy(model, built["prompt"])  # 16 decode steps past the window, on every layer
    assert tokens == built["tokens"]
    assert max(max_diff(a, b) for a, b in zip(steps, built["steps"])) <= FP32_ATOL


def test_lazy_experts_match_memory(built):
    memory = load_model(built["path"], experts="memory")
    lazy = load_model(built["path"], experts="lazy")
    assert torch.equal(memory(built["prompt"], memory.new_cache()), lazy(built["prompt"], lazy.new_cache()))
    assert lazy.experts.reads > 0


def test_a_prompt_in_chunks_matches_it_whole(built):
    """A prompt fed in chunks attends across the chunk boundary through the window's mask and the sinks."""
    model = load_model(built["path"])
    cache = model.new_cache()
    parts = [model(built["prompt"][:, a:b], cache) for a, b in ((0, 4), (4, 9), (9, PROMPT_LEN))]
    assert max_diff(torch.cat(parts, dim=1), built["prefill"]) <= FP32_ATOL


def test_batched_steps_give_each_sequence_its_alone_logits(built):
    """Two prompts and a third joining beside their decode tokens, on a KV slab: each sequence's logits alone."""
    from fate_edge.model.kv_slab import KVSlab

    model = load_model(built["path"], dtype=torch.float32)
    full = built["prompt"][0].tolist()
    prompts, n = [full, full[:4], full[3:11]], 8  # decode past the window in each
    expected = [_alone(model, p, n) for p in prompts]
    got, segs = batched_with_a_joiner(model, KVSlab(model, 3 * 32), prompts, n, 32)
    for j, (ours, alone) in enumerate(zip(got, expected)):
        assert len(ours) == n + 1
        assert max(max_diff(a, b) for a, b in zip(ours, alone)) <= FP32_ATOL, f"sequence {j}"


# Each feature switched off in the runtime must move the logits: else the parity above would pass without it.
def _set(**changes):
    def apply(model):
        model.config = replace(model.config, **changes)

    return apply


def _drop(suffix: str):
    def apply(model):
        for name in [n for n in model.w if n.endswith(suffix)]:
            del model.w[name]

    return apply


def _zero(suffix: str):
    def apply(model):
        for name in [n for n in model.w if n.endswith(suffix)]:
            model.w[name] = torch.zeros_like(model.w[name])

    return apply


def _expert_change(**changes):
    def apply(model):
        for key, e in model.experts.experts.items():
            assert isinstance(e, ExpertWeights) and e.bias is not None
            model.experts.experts[key] = replace(e, **changes)

    return apply


def _default_rope(model):
    cfg = model.config
    cfg.rope = replace(cfg.rope, rope_type="default", factor=1.0)
    model.rope = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)


def _truncated_yarn(model):
    cfg = model.config
    cfg.rope = replace(cfg.rope, truncate=True)
    model.rope = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)


VARIANTS = {
    "sinks": _drop("self_attn.sinks"),
    "window": _set(sliding_window=None, sliding_window_layers=()),
    "qkv_bias": _zero("k_proj.bias"),
    "o_bias": _zero("o_proj.bias"),
    "router_bias": _drop("mlp.router.bias"),
    "expert_bias": _expert_change(bias=None),
    "clamp": _expert_change(glu=Glu(None, 1.702)),
    "rope_yarn": _default_rope,
    "yarn_untruncated": _truncated_yarn,  # gpt-oss's YaRN keeps the correction range unrounded
}


@pytest.mark.parametrize("switch_off", VARIANTS.values(), ids=VARIANTS.keys())
def test_variant_is_exercised(built, switch_off):
    model = load_model(built["path"])
    with_variant = model(built["prompt"], model.new_cache())
    assert max_diff(with_variant, built["prefill"]) <= FP32_ATOL
    switch_off(model)
    assert max_diff(with_variant, model(built["prompt"], model.new_cache())) > 1e-2


def test_sink_attention_is_transformers_eager_attention():
    """The one sink formula against transformers' own gpt-oss attention, grouped heads and a causal window mask."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g), torch.randn(2, 2, 6, 8)
    sinks = torch.randn(4, generator=g)
    pos = torch.arange(6)
    mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - 3)
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups, module.training = sinks, 2, False
    additive = torch.zeros(6, 6).masked_fill(~mask, float("-inf"))[None, None]
    ref, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.3)
    ours = sink_attention(q, k, v, 0.3, sinks, mask)
    assert max_diff(ours.transpose(1, 2), ref) <= 1e-6


def test_a_static_buffer_attends_with_sinks_as_the_growing_cache_does(built):
    """The whole-capacity buffer (compiled and graph steps' state) takes the sinks too: one query over its written
    positions with a zeroed tail equals the same query over a sequence's prefix."""
    cfg = load_model(built["path"]).config
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 4, 1, 16, generator=g), torch.randn(1, 2, 7, 16, generator=g), torch.randn(1, 2, 7, 16)
    sinks = torch.randn(4, generator=g)
    pad = torch.zeros(1, 2, 9, 16)
    mask = (torch.arange(16) < 7).view(1, -1)
    full = 1  # a full-attention layer
    prefix = attend(cfg, q, (k, v), full, 0.25, sinks)
    static = attend(cfg, q, Held((torch.cat([k, pad], 2), torch.cat([v, pad], 2)), mask=mask), full, 0.25, sinks)
    assert max_diff(prefix, static) <= 1e-6
    assert max_diff(prefix, attend(cfg, q, (k, v), full, 0.25)) > 1e-3  # the sinks moved it


def test_the_compiled_step_declines_it_by_name(built):
    """Its stacked experts take no biases or clamp: the compiled step says so (the CUDA graph step, the same check,
    needs a CUDA model to get that far)."""
    from fate_edge.model import compiled_step

    model = load_model(built["path"])
    assert compiled_step.unsupported(model) is not None
    full = load_model(build(built["path"].parent / "full", layer_types=["full_attention"] * 3)[1])
    assert not full.config.sliding_window_layers
    assert "gpt-oss" in (compiled_step.unsupported(full) or "")


def test_early_attention_takes_the_sinks():
    """The early-attention predictor's own-row attention (true keys before, the estimate on the diagonal) with the
    estimate equal to the truth is the model's attention: sinks and window included."""
    from fate_edge.predictors.early_attention import own_row_attention

    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(1, 4, 7, 8, generator=g), torch.randn(1, 2, 7, 8, generator=g), torch.randn(1, 2, 7, 8)
    sinks = torch.randn(4, generator=g)
    pos = torch.arange(7)
    mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - 3)
    want = sink_attention(q, k, v, 0.3, sinks, mask).transpose(1, 2).reshape(7, -1)
    assert max_diff(own_row_attention(q, k, v, k, v, 0.3, 3, sinks), want) <= 1e-5
    assert max_diff(own_row_attention(q, k, v, k, v, 0.3, 3), want) > 1e-3


def test_bf16_is_as_close_to_exact_as_transformers_bf16(built):
    """bf16 (transformers runs gpt-oss's eager attention only): our logits no further from the float32 ones than
    transformers' bf16 logits are (DESIGN's relative bar; this clamp-heavy tiny model is far from exact in both)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        built["path"], dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        theirs = hf(built["prompt"]).logits
    model = load_model(built["path"], dtype=torch.bfloat16)
    ours = model(built["prompt"], model.new_cache())
    assert ours.dtype == torch.bfloat16
    exact = built["prefill"]
    assert max_diff(ours, exact) <= max(2e-2, 1.25 * max_diff(theirs, exact))
    assert max_diff(ours, theirs) <= 5e-2


def test_a_long_prompt_attends_in_chunks_with_the_same_result(monkeypatch):
    """sink_attention's scores for a long prompt go in chunks of query rows (a whole 8k-token prompt's would be
    16 GB): chunked gives what at once does, masks of one row per query or one for all."""
    from fate_edge.model import attention

    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(1, 4, 9, 8, generator=g), torch.randn(1, 2, 9, 8, generator=g), torch.randn(1, 2, 9, 8)
    sinks = torch.randn(4, generator=g)
    pos = torch.arange(9)
    causal = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - 4)
    whole = [sink_attention(q, k, v, 0.3, sinks, m) for m in (causal, None, causal[-1:])]
    monkeypatch.setattr(attention, "SINK_CHUNK_SCORES", 4 * 9 * 2)  # two query rows a chunk
    for m, want in zip((causal, None, causal[-1:]), whole):
        assert max_diff(sink_attention(q, k, v, 0.3, sinks, m), want) <= 1e-6  # matmul blocking may round apart


def test_bf16_decode_steps_through_the_kernel_as_close_as_transformers_bf16(built, monkeypatch):
    """bf16 decode steps (past the window) take the sinks in fate-edge's CPU attention kernel where it runs here;
    each step's logits no further from the float32 ones than transformers' bf16 decode is."""
    from fate_edge.model import decode_attention

    calls: list[bool] = []
    real = decode_attention.attend
    monkeypatch.setattr(decode_attention, "attend", lambda *a, **kw: calls.append(len(a) > 4) or real(*a, **kw))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        built["path"], dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    model = load_model(built["path"], dtype=torch.bfloat16)
    cache = model.new_cache()
    ours = [model(built["prompt"], cache, last_only=True)[0, -1]]
    with torch.no_grad():
        out = hf(built["prompt"], use_cache=True)
        theirs, past = [out.logits[0, -1]], out.past_key_values
        for tok in built["tokens"][:-1]:
            ours.append(model(torch.tensor([[tok]]), cache)[0, -1])
            out = hf(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            theirs.append(out.logits[0, -1])
            past = out.past_key_values
    exact = built["steps"]
    ours_err = max(max_diff(a, e) for a, e in zip(ours, exact))
    assert ours_err <= max(2e-2, 1.25 * max(max_diff(b, e) for b, e in zip(theirs, exact)))
    if decode_attention.available()[0]:
        assert calls and all(calls)  # every decode attention took the kernel, with the sinks
