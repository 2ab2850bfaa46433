"""Logit and greedy-generation parity of the fate-edge runtime against transformers, per architecture.

Every checkpoint is a tiny random model built here by transformers (seeded, larger init std so routing is
not a coin toss on near-equal logits), saved with ``save_pretrained`` (the per-expert layout transformers 5
writes: ``mlp.experts.{j}.gate_proj`` or Mixtral's ``block_sparse_moe.experts.{j}.w1``) and rewritten into
the transformers-5 fused layout (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from _parity import (  # noqa: E402
    FP32_ATOL,
    Reference,
    check_batched_steps_match_alone,
    fuse_checkpoint,
    hf_reference,
    max_diff,
    one_quiet_thread,
    our_greedy,
    record_routing,
)
from _parity import NEW_TOKENS as NEW_TOKENS  # noqa: E402  (it and _alone: test_parity_gpt_oss imports them here)
from _parity import _alone as _alone  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from fate_edge.format.checkpoint import CheckpointReader  # noqa: E402
from fate_edge.format.checkpoint_experts import CheckpointExpertProvider, ExpertLayout  # noqa: E402
from fate_edge.model.rope import RotaryEmbedding  # noqa: E402
from fate_edge.runtime.loader import load_model  # noqa: E402

VOCAB = 128
PROMPT_LEN = 12
BF16_ATOL = 2e-2

# Sizes shared by every case; a case overrides what its variant needs.
_BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,  # generation must never stop early
    pad_token_id=None,
    tie_word_embeddings=False,
)

_MLA = dict(
    num_key_value_heads=4,  # MLA expands the latent to every head: no GQA
    intermediate_size=96,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    num_hidden_layers=3,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
)


@dataclass
class Case:
    id: str
    config_cls: str
    kwargs: dict
    prompt_len: int = PROMPT_LEN
    seed: int = 0


CASES = [
    Case("mixtral", "MixtralConfig", dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)),
    Case(
        "qwen2_moe-shared_gate-dense_layer",
        "Qwen2MoeConfig",
        dict(
            num_hidden_layers=3,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        ),
    ),
    Case(
        "qwen2_moe-sparse_step2-rope_linear",
        "Qwen2MoeConfig",
        dict(
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=2,  # layer 0 dense, layer 1 MoE
            norm_topk_prob=True,
            rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=10000.0),
        ),
    ),
    Case(
        "qwen3_moe-head_dim24-qk_norm",
        "Qwen3MoeConfig",
        dict(
            head_dim=24,  # != hidden / heads
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        ),
    ),
    Case(
        "qwen3_moe-rope_dynamic",
        "Qwen3MoeConfig",
        dict(
            head_dim=24,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            max_position_embeddings=16,  # the 24-token prompt outgrows it: the NTK base is raised
            # transformers ignores original_max_position_embeddings for dynamic NTK (it counts from
            # max_position_embeddings); the runtime must too.
            rope_parameters=dict(
                rope_type="dynamic", factor=2.0, rope_theta=10000.0, original_max_position_embeddings=8
            ),
        ),
        prompt_len=24,
    ),
    Case(
        "mixtral-sliding_window",
        "MixtralConfig",
        dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
        seed=1,
    ),
    Case("olmoe-qk_norm", "OlmoeConfig", dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2)),
    Case(
        "olmoe-clip_qkv",
        "OlmoeConfig",
        dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2, clip_qkv=0.5, norm_topk_prob=True),
    ),
    Case(
        "deepseek_v2-q_proj-greedy",
        "DeepseekV2Config",
        dict(**_MLA, q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.0),
    ),
    Case(
        "deepseek_v2-q_lora-group_limited",
        "DeepseekV2Config",
        dict(
            **_MLA,
            q_lora_rank=24,
            topk_method="group_limited_greedy",
            # One group of four: with topk_group >= top_k the group limit could never change a top-k pick.
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.5,
        ),
    ),
    Case(
        "deepseek_v3-sigmoid_bias-rope_yarn",
        "DeepseekV3Config",
        dict(
            **_MLA,
            q_lora_rank=24,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=32,
                mscale=0.707,
                mscale_all_dim=1.0,
                beta_fast=32,
                beta_slow=1,
            ),
        ),
    ),
    Case(
        "glm4_moe-partial_rope-qk_norm-sigmoid_groups",
        "Glm4MoeConfig",
        dict(
            intermediate_size=96,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            num_hidden_layers=3,
            head_dim=24,  # != hidden / heads; rope on its first 12
            attention_bias=True,
            use_qk_norm=True,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
        ),
    ),
    Case(
        "glm4_moe-air-no_qk_norm-unnormalised",
        "Glm4MoeConfig",
        dict(
            intermediate_size=96,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=2,
            first_k_dense_replace=0,
            attention_bias=False,
            use_qk_norm=False,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
        ),
    ),
    Case(
        "minimax_m2-partial_rope-full_qk_norm-sigmoid_bias",
        "MiniMaxM2Config",
        dict(
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            head_dim=24,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
        ),
    ),
    Case(
        "ernie4_5_moe-interleaved_rope-selection_bias-interval2",
        "Ernie4_5_MoeConfig",
        dict(
            intermediate_size=96,
            moe_intermediate_size=32,
            moe_num_experts=8,
            moe_k=2,
            moe_num_shared_experts=1,
            num_hidden_layers=4,
            moe_layer_start_index=1,
            moe_layer_interval=2,  # layers 1 and 3 routed, 0 and 2 dense
            use_bias=False,
        ),
    ),
]
CASE_IDS = [c.id for c in CASES]
LAYOUTS = ["per_expert", "fused"]


class Built:
    """One case's transformers model, its two checkpoint directories and its prompt."""

    def __init__(self, case: Case, root: Path):
        self.case = case
        config = getattr(transformers, case.config_cls)(**{**_BASE, **case.kwargs})
        torch.manual_seed(case.seed)
        hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
        with torch.no_grad():
            for name, buf in [*hf.named_buffers(), *hf.named_parameters()]:  # ERNIE's is a frozen parameter
                if name.endswith("e_score_correction_bias"):  # zeros by default: make the selection-only bias bite
                    buf.copy_(torch.randn_like(buf) * 0.2)
        self.hf = hf
        self.dirs = {"per_expert": root / case.id / "per_expert", "fused": root / case.id / "fused"}
        hf.save_pretrained(self.dirs["per_expert"])
        fuse_checkpoint(self.dirs["per_expert"], self.dirs["fused"])
        self.prompt = torch.randint(0, VOCAB, (1, case.prompt_len), generator=torch.Generator().manual_seed(1234))
        self._reference: Reference | None = None

    def reset_hf_rope(self, hf: torch.nn.Module | None = None) -> None:
        """transformers' dynamic NTK rope keeps the frequencies of the longest sequence it saw: start afresh."""
        hf = hf or self.hf
        hf.model.rotary_emb = type(hf.model.rotary_emb)(hf.config)

    @property
    def reference(self) -> Reference:
        if self._reference is None:
            self._reference = hf_reference(self.hf, self.prompt, self.reset_hf_rope)
        return self._reference


@pytest.fixture(scope="module", autouse=True)
def _one_quiet_thread():
    with one_quiet_thread():
        yield


MEASURED: dict[str, float] = {}


class Registry:
    """Each case's model is built on first use and shared by every test of this module."""

    def __init__(self, root: Path):
        self.root = root
        self.built: dict[str, Built] = {}

    def get(self, case: Case) -> Built:
        if case.id not in self.built:
            self.built[case.id] = Built(case, self.root)
        return self.built[case.id]


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    yield Registry(tmp_path_factory.mktemp("parity_models"))
    if MEASURED:  # shown with pytest -s
        print("\nmax abs logit diff vs transformers:")
        for k, v in MEASURED.items():
            print(f"  {k}: {v:.2e}")


@pytest.fixture
def built(request, registry: Registry) -> Built:
    return registry.get(request.param)


def by_id(*ids: str) -> list[Case]:
    return [c for c in CASES if c.id in ids]


# --------------------------------------------------------------------------------------------- fp32 parity
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("built", CASES, ids=CASE_IDS, indirect=True)
def test_logits_and_greedy_match_transformers(built: Built, layout: str):
    ref = built.reference
    model = load_model(built.dirs[layout], dtype=torch.float32)
    routing = record_routing(model)
    logits = model(built.prompt, model.new_cache())
    assert logits.shape == ref.prefill.shape
    diff = max_diff(logits, ref.prefill)
    MEASURED[f"{built.case.id}/{layout}/prefill"] = diff
    assert diff <= FP32_ATOL, f"prefill logits (all positions) differ by {diff:.3g}"
    # The comparison means something only if tokens spread over the experts.
    cfg = model.config
    assert {layer for layer, _ in routing} == set(cfg.moe_layers)
    for layer, idx in routing:
        assert idx.unique().numel() > cfg.num_experts_per_tok, f"layer {layer}: every token picked the same experts"

    tokens, steps = our_greedy(model, built.prompt)
    step_diff = max(max_diff(a, b) for a, b in zip(steps, ref.step_logits))
    MEASURED[f"{built.case.id}/{layout}/decode"] = step_diff
    assert tokens == ref.tokens
    assert step_diff <= FP32_ATOL, f"decode-step logits differ by {step_diff:.3g}"


class _RowCounter:
    """A routing observer that does not need every prompt token: rows routed per MoE layer call."""

    needs_every_token = False

    def __init__(self):
        self.rows: list[tuple[int, int]] = []

    def __call__(self, layer, h, idx, w):
        self.rows.append((layer, idx.shape[0]))


@pytest.mark.parametrize("built", CASES, ids=CASE_IDS, indirect=True)
def test_a_prompt_asked_for_its_last_logits_runs_the_last_mlp_on_one_row_and_still_matches(built: Built):
    """With only the last logits asked for, the last layer's MLP or MoE runs on the last position alone (its
    attention still writes every position's keys and values): the prompt's last logits and every decode step
    after it still match transformers."""
    ref = built.reference
    model = load_model(built.dirs[LAYOUTS[0]], dtype=torch.float32)
    counter = _RowCounter()
    model.observers.append(counter)
    tokens, steps = our_greedy(model, built.prompt)
    last = model.config.num_hidden_layers - 1
    prompt_calls = counter.rows[: len(model.config.moe_layers)]
    n = built.prompt.shape[1]
    assert prompt_calls == [(layer, 1 if layer == last else n) for layer in model.config.moe_layers]
    step_diff = max(max_diff(a, b) for a, b in zip(steps, ref.step_logits))
    assert tokens == ref.tokens
    assert step_diff <= FP32_ATOL, f"logits after a pruned last layer differ by {step_diff:.3g}"
    model.observers.append(lambda *a: None)  # an observer that may need every token: nothing pruned
    counter.rows.clear()
    model(built.prompt, model.new_cache(), last_only=True)
    assert [rows for _, rows in counter.rows] == [n] * len(model.config.moe_layers)


@pytest.mark.parametrize("built", CASES, ids=CASE_IDS, indirect=True)
def test_batched_steps_give_each_sequence_its_alone_logits(built: Built):
    """Continuous batching (``batch_step.forward_segments``) on every architecture, MLA included: two prompts of
    different lengths in one step, a third prompt joining beside their decode tokens, then decode steps of all
    three, on caches that are ranges of one KV slab. Every step's logits are each sequence's alone (fp32)."""
    check_batched_steps_match_alone(load_model(built.dirs["per_expert"], dtype=torch.float32), built.prompt)


# Each variant must change the output when switched off in the runtime: otherwise the parity test above would
# pass whether or not the runtime implements it.
def _set(**changes):
    def apply(model):
        model.config = replace(model.config, **changes)

    return apply


def _default_rope(model):
    cfg = model.config
    cfg.rope = replace(cfg.rope, rope_type="default", factor=1.0)
    model.rope = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)


def _no_correction_bias(model):
    for name in [n for n in model.w if n.endswith("e_score_correction_bias")]:
        del model.w[name]


def _ungated_shared_expert(model):
    for name in [n for n in model.w if n.endswith("shared_expert_gate.weight")]:
        model.w[name] = torch.full_like(model.w[name], 0.0)  # sigmoid(0) = 0.5 instead of the learned gate


VARIANTS = [
    ("mixtral-sliding_window", "window", _set(sliding_window=None, sliding_window_layers=())),
    ("qwen2_moe-shared_gate-dense_layer", "shared_expert_gate", _ungated_shared_expert),
    ("qwen2_moe-sparse_step2-rope_linear", "rope_linear", _default_rope),
    ("qwen2_moe-sparse_step2-rope_linear", "norm_topk_prob", _set(norm_topk_prob=False)),
    ("qwen3_moe-head_dim24-qk_norm", "norm_topk_prob", _set(norm_topk_prob=False)),
    ("qwen3_moe-rope_dynamic", "rope_dynamic", _default_rope),
    ("olmoe-clip_qkv", "clip_qkv", _set(clip_qkv=None)),
    ("deepseek_v2-q_lora-group_limited", "group_limited", _set(topk_method="greedy")),
    ("deepseek_v2-q_lora-group_limited", "routed_scaling", _set(routed_scaling_factor=1.0)),
    ("deepseek_v3-sigmoid_bias-rope_yarn", "correction_bias", _no_correction_bias),
    ("deepseek_v3-sigmoid_bias-rope_yarn", "group_limit", _set(topk_group=4)),
    ("deepseek_v3-sigmoid_bias-rope_yarn", "norm_topk_prob", _set(norm_topk_prob=False)),
    ("deepseek_v3-sigmoid_bias-rope_yarn", "rope_yarn", _default_rope),
]


@pytest.mark.parametrize(
    ("built", "switch_off"),
    [(by_id(case_id)[0], fn) for case_id, _, fn in VARIANTS],
    ids=[f"{case_id}:{name}" for case_id, name, _ in VARIANTS],
    indirect=["built"],
)
def test_variant_is_exercised(built: Built, switch_off):
    model = load_model(built.dirs["per_expert"])
    with_variant = model(built.prompt, model.new_cache())
    switch_off(model)
    without = model(built.prompt, model.new_cache())
    assert max_diff(with_variant, without) > 1e-2


@pytest.mark.parametrize("built", by_id("deepseek_v3-sigmoid_bias-rope_yarn"), ids=["deepseek_v3"], indirect=True)
def test_correction_bias_is_saved(built: Built):
    """e_score_correction_bias is a buffer: it must reach the checkpoint, and the runtime must load it."""
    saved = {k: v for k, v in load_file(built.dirs["per_expert"] / "model.safetensors").items() if "correction" in k}
    assert saved and all(v.abs().sum() > 0 for v in saved.values())
    model = load_model(built.dirs["fused"])
    for name, value in saved.items():
        assert torch.equal(model.w[name], value)


@pytest.mark.parametrize("built", by_id("qwen3_moe-rope_dynamic"), ids=["qwen3_moe-rope_dynamic"], indirect=True)
def test_dynamic_rope_state_follows_transformers(built: Built):
    """transformers keeps the grown NTK base while sequences stay long and resets it for one within the
    trained context; the runtime's rope (shared by every cache of a model) must do the same."""
    model = load_model(built.dirs["per_expert"])
    built.reset_hf_rope()
    short = built.prompt[:, :8]
    with torch.no_grad():
        for prompt in (built.prompt, built.prompt[:, :20], short, built.prompt):
            ref = built.hf(prompt).logits
            diff = max_diff(model(prompt, model.new_cache()), ref)
            assert diff <= FP32_ATOL, f"{prompt.shape[1]}-token prompt after the others: {diff:.3g}"


# --------------------------------------------------------------------------------------------------- bf16
@pytest.mark.parametrize(
    "built",
    by_id("qwen3_moe-head_dim24-qk_norm", "deepseek_v2-q_proj-greedy", "deepseek_v3-sigmoid_bias-rope_yarn"),
    ids=["qwen3_moe", "deepseek_v2", "deepseek_v3"],
    indirect=True,
)
def test_bf16_matches_transformers_bf16(built: Built):
    # transformers' default (sdpa) attention: eager rounds the score matrix to bf16 before the softmax, which
    # alone moves the last logits by ~2e-2 here; sdpa accumulates in float32 like the runtime does.
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        built.dirs["per_expert"], dtype=torch.bfloat16, attn_implementation="sdpa"
    ).eval()
    built.reset_hf_rope(hf)
    with torch.no_grad():
        ref = hf(built.prompt).logits[0, -1]
    model = load_model(built.dirs["per_expert"], dtype=torch.bfloat16)
    ours = model(built.prompt, model.new_cache(), last_only=True)[0, -1]
    assert ours.dtype == torch.bfloat16
    diff = max_diff(ours, ref)
    MEASURED[f"{built.case.id}/bf16/last"] = diff
    assert diff <= BF16_ATOL
    # And no less accurate than transformers' own bf16 run, measured against the float32 logits.
    exact = built.reference.prefill[0, -1]
    assert max_diff(ours, exact) <= max(BF16_ATOL, 1.25 * max_diff(ref, exact))


@pytest.mark.parametrize(
    "built",
    by_id(
        "qwen2_moe-shared_gate-dense_layer",
        "mixtral-sliding_window",
        "qwen3_moe-head_dim24-qk_norm",
        "deepseek_v2-q_proj-greedy",
    ),
    ids=["qwen2_moe", "mixtral_window", "qwen3_moe", "deepseek_v2"],
    indirect=True,
)
def test_bf16_decode_steps_match_transformers_bf16(built: Built):
    # Decode queries in bf16 take fate-edge's CPU attention kernel (model/decode_attention.py) and, on the one-token
    # path, rope as an fp32 matmul: each step, fed the reference's greedy tokens, beside transformers' bf16 decode
    # with its own cache.
    ref = built.reference
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        built.dirs["per_expert"], dtype=torch.bfloat16, attn_implementation="sdpa"
    ).eval()
    built.reset_hf_rope(hf)
    model = load_model(built.dirs["per_expert"], dtype=torch.bfloat16)
    cache = model.new_cache()
    ours = [model(built.prompt, cache, last_only=True)[0, -1]]
    with torch.no_grad():
        out = hf(built.prompt, use_cache=True)
        theirs, past = [out.logits[0, -1]], out.past_key_values
        for tok in ref.tokens[:-1]:
            ours.append(model(torch.tensor([[tok]]), cache)[0, -1])
            out = hf(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            theirs.append(out.logits[0, -1])
            past = out.past_key_values
    # Two bf16 runs each within a rounding or two of the exact logits can be two roundings apart (a logit near 6
    # moves in steps of 0.03 in bf16), so the bar is accuracy: our distance to the float32 logits, step by step,
    # at most one bf16 rounding more than transformers' own bf16 distance, and over the run no more than 1.25x it.
    ours_err = [max_diff(a, exact) for a, exact in zip(ours, ref.step_logits)]
    theirs_err = [max_diff(b, exact) for b, exact in zip(theirs, ref.step_logits)]
    MEASURED[f"{built.case.id}/bf16/decode vs float32 (transformers bf16)"] = max(ours_err)
    MEASURED[f"{built.case.id}/bf16/decode vs transformers bf16"] = max(map(max_diff, ours, theirs))
    assert max(ours_err) <= 1.25 * max(theirs_err)
    for step, (o, t, exact) in enumerate(zip(ours_err, theirs_err, ref.step_logits)):
        ulp = 2.0 ** (math.floor(math.log2(exact.abs().max().item())) - 7)  # bf16's spacing at the largest logit
        assert o <= t + ulp, f"step {step}: {o:.3g} from the float32 logits, transformers {t:.3g}"


# ----------------------------------------------------------------------------------------- fused checkpoints
@pytest.mark.parametrize("built", CASES, ids=CASE_IDS, indirect=True)
def test_fused_checkpoint_loads_in_transformers(built: Built):
    """The rewritten file is the layout transformers 5 itself uses: it loads there, to the same weights."""
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(built.dirs["fused"], attn_implementation="eager").eval()
    want, got = built.hf.state_dict(), hf2.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    built.reset_hf_rope(hf2)
    with torch.no_grad():
        assert max_diff(hf2(built.prompt).logits, built.reference.prefill) <= 1e-5


@pytest.mark.parametrize("built", by_id("deepseek_v3-sigmoid_bias-rope_yarn"), ids=["deepseek_v3"], indirect=True)
def test_fused_row_read_is_one_expert(built: Built):
    """``ExpertLayout.read`` on a fused tensor materialises that expert's row only, equal to transformers' weights."""
    reader = CheckpointReader(built.dirs["fused"])
    layer = built.hf.config.first_k_dense_replace
    prefix = f"model.layers.{layer}.mlp"
    name = f"{prefix}.experts.gate_up_proj"
    row = reader.get_row(name, 3)
    row_bytes = row.numel() * row.element_size()
    assert row_bytes * reader.shape(name)[0] == reader.nbytes(name)
    storage = row.untyped_storage()
    if storage.nbytes() != row_bytes:
        # safetensors >= 0.6 memory-maps the file: the row must then be a zero-copy view at its own offset (the
        # other experts' pages are never touched), not a copy of the whole fused tensor.
        assert storage.nbytes() == reader.nbytes(name)
        assert row.data_ptr() - storage.data_ptr() == 3 * row_bytes
    w = ExpertLayout(reader, prefix).read(3, torch.float32)
    hf_experts = built.hf.model.layers[layer].mlp.experts
    inter = built.hf.config.moe_intermediate_size
    assert torch.equal(w.gate, hf_experts.gate_up_proj[3, :inter])
    assert torch.equal(w.up, hf_experts.gate_up_proj[3, inter:])
    assert torch.equal(w.down, hf_experts.down_proj[3])


# ------------------------------------------------------------------------------------------ lazy experts
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("built", by_id("deepseek_v3-sigmoid_bias-rope_yarn"), ids=["deepseek_v3"], indirect=True)
def test_lazy_experts_match_memory_and_read_only_routed(built: Built, layout: str, monkeypatch):
    memory = load_model(built.dirs[layout], experts="memory")
    lazy = load_model(built.dirs[layout], experts="lazy")
    provider = lazy.experts
    assert isinstance(provider, CheckpointExpertProvider)
    mem_cache, lazy_cache = memory.new_cache(), lazy.new_cache()
    assert torch.equal(memory(built.prompt, mem_cache), lazy(built.prompt, lazy_cache))

    # One decode step: each MoE layer routes one token to k of the experts; exactly those are read from disk.
    layouts = provider.layouts
    reader = next(iter(layouts.values())).reader
    reads: list[tuple[str, int | None]] = []
    get, get_row = reader.get, reader.get_row
    monkeypatch.setattr(reader, "get", lambda name, dtype=None: reads.append((name, None)) or get(name, dtype))
    monkeypatch.setattr(
        reader, "get_row", lambda name, i, dtype=None: reads.append((name, i)) or get_row(name, i, dtype)
    )
    provider.reads = provider.bytes_read = 0
    routing = record_routing(lazy)
    token = torch.tensor([[5]])
    assert torch.equal(memory(token, mem_cache), lazy(token, lazy_cache))

    cfg = lazy.config
    routed = [(layer, e) for layer, idx in routing for e in idx.unique().tolist()]
    assert len(routed) == len(cfg.moe_layers) * cfg.num_experts_per_tok < len(cfg.moe_layers) * cfg.num_experts
    expected = []
    for layer, e in routed:
        names = layouts[layer].tensor_names(e)
        expected += [(n, e) for n in names] if layouts[layer].fused else [(n, None) for n in names]
    assert sorted(reads) == sorted(expected)
    assert provider.reads == len(routed)
    assert provider.bytes_read == len(routed) * cfg.expert_params * 4  # fp32
