"""The multi-token MoE block (prefill) groups its (token, expert) pairs by expert: the same logits, bit for bit,
as the per-expert-mask path it replaced, with one gather and one indexed add per layer instead of a mask, a
``nonzero`` and an indexed add per expert."""

from collections import Counter

import pytest
import torch
from _tiny_moe import build_tiny_moe
from torch.profiler import ProfilerActivity, profile

from fate_edge import load_model
from fate_edge.model.dispatch import group_by_expert
from fate_edge.model.transformer import MoETransformer

PROMPT = torch.tensor([[5, 300, 17, 2048, 99, 1000, 7, 64, 12, 400, 3, 77]])


def masked_routed(self, h, layer, idx, weights):
    """The block as it was before grouping: one mask, nonzero and indexed add per expert (the reference)."""
    ids, counts = idx.flatten().unique(return_counts=True)
    needed = ids[counts.argsort(descending=True, stable=True)].tolist()
    parts = {}
    for e, expert in self.experts.stream(layer, needed):
        if expert is None:
            continue
        tok, slot = torch.where(idx == e)
        parts[e] = (tok, (expert(h[tok]).float() * weights[tok, slot, None]).to(h.dtype))
    self.experts.end_layer(layer)
    out = torch.zeros_like(h)
    for e in sorted(parts):
        tok, y = parts[e]
        out[tok] += y
    return out


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
    monkeypatch.setattr(MoETransformer, "_routed", masked_routed)
    want, old_ops = prefill_ops(model, PROMPT)
    assert torch.equal(got, want)
    moe_layers = sum(lp.router is not None for lp in model.plan())
    assert ops["aten::nonzero"] == 0 and old_ops["aten::nonzero"] >= 2 * moe_layers  # one per expert before
    k = 1 if dtype == torch.float32 else model.config.num_experts_per_tok  # bf16: one pass per rank (see _routed)
    assert ops["aten::index_add_"] == k * moe_layers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_prefill_equals_the_masked_path_on_int4_experts(tmp_path, one_thread, monkeypatch, dtype):
    """The tiny qwen2_moe test model (top-4 of 8, a dense layer) with int4 experts and int4 resident weights: in
    bf16 too a token's four experts round after each add, in expert-id order, as ``out[tok] += y`` did."""
    d = build_tiny_moe(tmp_path / "tiny", top_k=4, expert_dim=32)
    model = load_model(d, dtype, bits=4, resident_bits=4)
    ids = torch.arange(3, 3 + 40).view(1, 40) * 7 % 300
    got, _ = prefill_ops(model, ids)
    monkeypatch.setattr(MoETransformer, "_routed", masked_routed)
    want, _ = prefill_ops(model, ids)
    assert torch.equal(got, want)
