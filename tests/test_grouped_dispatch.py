"""The multi-token MoE block (prefill) groups its (token, expert) pairs by expert: the same logits, bit for bit,
as a per-expert-mask path adding each row's experts one row at a time, with one gather and k passes per layer
instead of a mask and a ``nonzero`` per expert and an add per (row, expert)."""

from collections import Counter

import pytest
import torch
from _tiny_moe import build_tiny_moe
from torch.profiler import ProfilerActivity, profile

from fate_edge import load_model
from fate_edge.model import routed_experts
from fate_edge.model.dispatch import group_by_expert
from fate_edge.model.layer_step import ExpertInput, add_routed, expert_rows

PROMPT = torch.tensor([[5, 300, 17, 2048, 99, 1000, 7, 64, 12, 400, 3, 77]])


def masked_sum(model, acc, h, layer, weights, idx, decode):
    """The block as it was before grouping, per expert a mask, a ``nonzero`` and its rows' outputs, then each row's
    experts summed one row at a time in expert-id order (the reference for the grouped block's k passes)."""
    ids, counts = idx.flatten().unique(return_counts=True)
    needed = ids[counts.argsort(descending=True, stable=True)].tolist()
    out = {}
    for e, expert in model.experts.stream(layer, needed):
        if expert is None:
            continue
        tok, slot = torch.where(idx == e)
        ys = expert_rows(expert, ExpertInput(h[tok], decode))
        for j, (t, s) in enumerate(zip(tok.tolist(), slot.tolist())):
            out[t, e] = (ys[j : j + 1], weights[t, s : s + 1])
    model.experts.end_layer(layer)
    rows: dict[int, torch.Tensor | None] = {t: None if acc is None else acc[t : t + 1] for t in range(h.shape[0])}
    for t, e in sorted(out):
        rows[t] = add_routed(rows[t], *out[t, e])
    return acc if acc is not None else torch.cat([rows[t] for t in range(h.shape[0])])


def prefill_ops(model, ids) -> tuple[torch.Tensor, Counter]:
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        logits = model(ids, model.new_cache())
    return logits, Counter(e.name for e in prof.events() if e.name.startswith("aten::"))  # nested ones too


def test_grouping_keeps_token_order_within_each_expert():
    idx = torch.tensor([[3, 1], [1, 0], [3, 0], [2, 1]])
    g = group_by_expert(idx)
    assert g.ids == [0, 1, 2, 3] and g.counts == {0: 2, 1: 3, 2: 1, 3: 2} and g.starts == [0, 2, 5, 6]
    assert g.tokens.tolist() == [1, 2, 0, 1, 3, 3, 0, 2]
    assert idx.flatten()[g.order].tolist() == [0, 0, 1, 1, 1, 2, 3, 3]
    assert g.by_popularity() == [1, 0, 3, 2]
    assert g.tokens[g.by_rank(idx)].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]  # each token's 1st expert, then its 2nd
    assert idx.flatten()[g.order][g.by_rank(idx)].tolist() == [1, 0, 0, 1, 3, 1, 3, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_prefill_equals_the_masked_path_on_the_bundled_model(bundled_dir, one_thread, monkeypatch, dtype):
    model = load_model(bundled_dir, dtype)
    got, ops = prefill_ops(model, PROMPT)
    monkeypatch.setattr(routed_experts, "routed_grouped", masked_sum)
    want, old_ops = prefill_ops(model, PROMPT)
    assert torch.equal(got, want)
    plan = model.plan()
    moe_layers = sum(lp.router is not None for lp in plan)
    assert ops["aten::nonzero"] == 0 and old_ops["aten::nonzero"] >= 2 * moe_layers  # one per expert before
    # k passes per MoE layer (pass j: every row's j-th expert, an addcmul into the float32 residual; a bf16 model's
    # first pass a product into its float32 accumulator instead), and Qwen's gated shared experts' one addcmul each
    gated = sum(lp.router is not None and lp.mlp is not None and len(lp.mlp.sizes) == 3 for lp in plan)
    passes = model.config.num_experts_per_tok - (dtype != torch.float32)
    assert ops["aten::addcmul_"] == passes * moe_layers + gated
    assert ops["aten::index_add_"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_prefill_equals_the_masked_path_on_int4_experts(tmp_path, one_thread, monkeypatch, dtype):
    """The tiny qwen2_moe test model (top-4 of 8, a dense layer) with int4 experts and int4 resident weights: in
    bf16 too a token's four experts round after each add, in expert-id order, as one row at a time does."""
    d = build_tiny_moe(tmp_path / "tiny", top_k=4, expert_dim=32)
    model = load_model(d, dtype, bits=4, resident_bits=4)
    ids = torch.arange(3, 3 + 40).view(1, 40) * 7 % 300
    got, _ = prefill_ops(model, ids)
    monkeypatch.setattr(routed_experts, "routed_grouped", masked_sum)
    want, _ = prefill_ops(model, ids)
    assert torch.equal(got, want)
