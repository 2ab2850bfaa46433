"""predictors/: the cross-layer gate predictor and its evaluation, on a tiny random qwen2_moe."""

import pytest
import torch
from _tiny_moe import build_tiny_moe
from fate_edge.predictors import CrossLayerGate, Prediction, next_moe_layers
from fate_edge.predictors.evaluate import (
    Trace,
    TraceRecorder,
    collect_traces,
    evaluate_predictor,
    exact_match,
    recall_at,
    usage_stats,
)

from fate_edge.runtime.loader import load_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(build_tiny_moe(tmp_path_factory.mktemp("tiny-moe")))  # MoE layers 0, 1, 3; layer 2 dense


@pytest.fixture(scope="module")
def trace(model):
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, model.config.vocab_size, (2, 48), generator=gen) for _ in range(3)]
    return collect_traces(model, batches)


def test_next_moe_layers_skips_dense_layers():
    assert next_moe_layers([0, 1, 3, 4], 1, 1) == (3,)
    assert next_moe_layers([0, 1, 3, 4], 2, 2) == (3, 4)  # from a dense layer
    assert next_moe_layers([0, 1, 3, 4], 0, 4) == (1, 3, 4)
    assert next_moe_layers([0, 1, 3, 4], 4, 1) == ()


def test_stacked_lookahead_equals_one_gate_per_layer(model):
    p4 = CrossLayerGate.from_model(model, lookahead=4)
    h = torch.randn(5, model.config.hidden_size)
    pred = p4.predict(0, h)
    assert pred.layers == (1, 3) and pred.scores.shape == (2, 5, model.config.num_experts)
    for j in pred.layers:
        w = model.w[f"model.layers.{j}.mlp.gate.weight"]
        torch.testing.assert_close(pred.for_layer(j), torch.softmax(h @ w.T, dim=-1))
    assert torch.equal(pred.topk(3), pred.scores.topk(3, dim=-1).indices)
    assert p4.predict(3, h).layers == ()  # last MoE layer: nothing to predict


def test_norm_variant_rescales_by_the_ratio_of_norm_weights(model):
    pred = CrossLayerGate.from_model(model, lookahead=2, norm_variant=True).predict(1, h := torch.randn(4, 32))
    assert pred.layers == (3,)  # dense layer 2 skipped
    n1 = model.w["model.layers.1.post_attention_layernorm.weight"]
    n3 = model.w["model.layers.3.post_attention_layernorm.weight"]
    w3 = model.w["model.layers.3.mlp.gate.weight"]
    torch.testing.assert_close(pred.for_layer(3), torch.softmax((h * n3 / n1) @ w3.T, dim=-1))
    plain = CrossLayerGate.from_model(model, lookahead=2).predict(1, h)
    assert not torch.allclose(plain.scores, pred.scores)


def test_trace_records_every_moe_layer(model, trace):
    assert trace.layers == [0, 1, 3]
    assert trace.tokens == 3 * 2 * 48 and trace.top_k == 2
    assert trace.gate_inputs[0].shape == (trace.tokens, 32)
    assert not model.observers  # the recorder is removed afterwards
    # The recorded experts are the router's choice on the recorded inputs.
    assert torch.equal(model.route(3, trace.gate_inputs[3])[1], trace.expert_ids[3])


def test_own_gate_on_own_input_is_perfect(model, trace):
    """Invariant: feeding layer j's own gate input to the predictor of j recovers the routing exactly."""
    shifted = Trace({0: trace.gate_inputs[1], 1: trace.gate_inputs[3]}, trace.expert_ids, trace.num_experts)
    for acc in evaluate_predictor(CrossLayerGate.from_model(model, lookahead=1), shifted, bytes_per_expert=100):
        assert acc.exact == 1.0
        assert all(r == 1.0 for r in acc.recall.values())
        assert acc.wasted_bytes[2] == 0.0 and acc.wasted_bytes[4] == pytest.approx(200.0)


def test_cross_layer_recall_is_partial_and_monotone_in_width(model, trace):
    results = evaluate_predictor(CrossLayerGate.from_model(model, lookahead=2), trace, bytes_per_expert=1000)
    pairs = {(a.source, a.target) for a in results}
    assert pairs == {(0, 1), (0, 3), (1, 3)}
    for acc in results:
        widths = sorted(acc.recall)
        assert widths == [2, 3, 4, 5, 6]
        recalls = [acc.recall[w] for w in widths]
        assert 0.0 < recalls[0] < 1.0
        assert recalls == sorted(recalls)
        assert acc.exact <= acc.recall[2]
        assert acc.wasted_bytes[2] == pytest.approx((1 - acc.recall[2]) * 2 * 1000, rel=1e-5)
    assert {a.distance for a in results if a.source == 0} == {1, 2}
    # Width covering every expert: recall 1, and the waste is everything else.
    full = evaluate_predictor(CrossLayerGate.from_model(model), trace, widths=[8, 20], bytes_per_expert=10)[0]
    assert list(full.recall) == [8] and full.recall[8] == 1.0 and full.wasted_bytes[8] == pytest.approx(60.0)


def test_metric_helpers():
    true = torch.tensor([[0, 1], [2, 3]])
    assert recall_at(torch.tensor([[1, 0], [2, 5]]), true) == 0.75
    assert exact_match(torch.tensor([[1, 0], [2, 5]]), true) == 0.5


def test_usage_stats():
    rec = TraceRecorder(num_experts=4, keep_inputs=False)
    rec(0, torch.zeros(4, 2), torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]]), torch.ones(4, 2))
    rec(1, torch.zeros(4, 2), torch.tensor([[0, 1], [0, 1], [0, 1], [0, 2]]), torch.ones(4, 2))
    balanced, skewed = usage_stats(rec.trace())
    assert balanced.entropy == pytest.approx(1.0) and balanced.top_share == 0.25
    assert skewed.top_share == 0.5 and skewed.top_expert == 0 and 0 < skewed.entropy < 1


def test_prediction_helpers():
    p = Prediction((3, 5), torch.tensor([[[0.1, 0.7, 0.2]], [[0.5, 0.2, 0.3]]]))
    assert torch.equal(p.for_layer(5), p.scores[1])
    assert p.topk(10).shape == (2, 1, 3)
    assert p.topk(1).flatten().tolist() == [1, 0]


def test_trace_rows_popularity_and_token_ids(model, trace):
    assert trace.token_ids is not None and trace.token_ids.shape == (trace.tokens,)
    tail = trace.rows(trace.tokens - 10)
    assert tail.tokens == 10 and torch.equal(tail.expert_ids[3], trace.expert_ids[3][-10:])
    assert torch.equal(tail.gate_inputs[0], trace.gate_inputs[0][-10:]) and torch.equal(tail.inputs(-1), tail.token_ids)
    pop = trace.popularity()
    assert sorted(pop) == [0, 1, 3] and all(sum(c) == trace.tokens * trace.top_k for c in pop.values())
    assert pop[1] == torch.bincount(trace.expert_ids[1].flatten(), minlength=8).tolist()


def test_stacked_matrix_is_what_predict_uses(model):
    gate = CrossLayerGate.from_model(model, lookahead=2, norm_variant=True)
    h = torch.randn(3, 32)
    w = gate.stacked(0)
    assert w.shape == (2 * 8, 32) and gate.stacked(3).shape == (0, 32)
    torch.testing.assert_close(torch.softmax((h @ w.T).view(3, 2, 8), -1).transpose(0, 1), gate.predict(0, h).scores)


@pytest.mark.parametrize(
    "config_cls,kwargs",
    [
        ("MiniMaxM2Config", dict(num_local_experts=8, intermediate_size=32, head_dim=16)),  # bias in the block
        (
            "Ernie4_5_MoeConfig",  # a softmax router with the bias in moe_statics, [1, E]
            dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=32, intermediate_size=64, moe_layer_start_index=0),
        ),
        (
            "Glm4MoeConfig",
            dict(n_routed_experts=8, moe_intermediate_size=32, intermediate_size=64, first_k_dense_replace=0),
        ),
    ],
    ids=["minimax_m2", "ernie4_5_moe", "glm4_moe"],
)
def test_cross_layer_gate_ranks_with_the_selection_bias_wherever_the_block_keeps_it(tmp_path, config_cls, kwargs):
    """Fed the target layer's own gate input, the cross-layer gate must choose what that layer's router chose:
    with the selection-only bias MiniMax-M2 keeps in the MoE block and ERNIE-4.5 in ``moe_statics``, as GLM in the
    router (without it the predictor ranked on the unbiased scores)."""
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, config_cls)(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        initializer_range=0.1,
        tie_word_embeddings=False,
        **kwargs,
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, buf in [*hf.named_buffers(), *hf.named_parameters()]:
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.3)
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path, torch.float32)
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    model.observers.append(lambda layer, h, idx, w: seen.setdefault(layer, (h.clone(), idx.clone())))
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(1)), model.new_cache())
    gate = CrossLayerGate.from_model(model)
    assert gate.bias is not None
    h1, chosen = seen[1]
    pred = gate.predict(0, h1)
    assert pred.layers == (1,)
    predicted = pred.scores[0].topk(2, dim=-1).indices
    assert torch.equal(predicted.sort(-1).values, chosen.sort(-1).values)


@pytest.mark.parametrize("norm_variant", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_row_ranks_one_row_as_predict_does(model, norm_variant, dtype):
    """The native one-row ranking (the router's kernel on the predictor's matrix) names the same experts in the same
    order as :meth:`CrossLayerGate.predict`'s scores ranked, for the nearest target, on the plain and the norm
    variant; None where the kernel is not built or the row's top n hold a tie."""
    from fate_edge.model import native_router
    from fate_edge.runtime.prefetch_choice import ranked

    gate = CrossLayerGate.from_model(model, lookahead=2, norm_variant=norm_variant)
    g = torch.Generator().manual_seed(7)
    e = gate.num_experts
    agreed = 0
    for layer in model.config.moe_layers[:-1]:
        for _ in range(8):
            h = torch.randn(1, model.config.hidden_size, generator=g).to(dtype)
            got = gate.top_row(layer, h, e)
            if not native_router.available()[0]:
                assert got is None
                continue
            if got is None:  # a tie among the scores: predict decides
                continue
            target, ranks = got
            pred = gate.predict(layer, h)
            assert target == pred.layers[0]
            assert ranks == ranked(pred.scores[0][0])[:e]
            agreed += 1
    assert agreed > 0 or not native_router.available()[0]


def test_top_row_declines_what_its_kernel_does_not_take(model):
    gate = CrossLayerGate.from_model(model)
    h = torch.randn(2, model.config.hidden_size)
    assert gate.top_row(model.config.moe_layers[0], h, 2) is None  # two rows: predict
    assert gate.top_row(model.config.moe_layers[-1], h[:1], 2) is None  # no layer ahead
