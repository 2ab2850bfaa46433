"""predictors/: token popularity, activation path (MoE-Infinity) and the oracle, on hand-made data."""

import pytest
import torch
from _tiny_moe import build_tiny_moe
from fate_edge.predictors import (
    EMBEDDING,
    ActivationPathPredictor,
    CallRecorder,
    CrossLayerGate,
    OraclePredictor,
    Prediction,
    TokenPopularity,
)
from fate_edge.predictors.evaluate import Trace, collect_traces, evaluate_predictor

from fate_edge.runtime.loader import load_model

pytestmark = pytest.mark.usefixtures("one_thread")


def top(pred: Prediction, k: int, target: int = 0, row: int = 0) -> list[int]:
    return pred.topk(k)[target, row].tolist()


# ------------------------------------------------------------------------------------------- interface
def test_observe_and_reset_are_no_ops_on_stateless_predictors():
    gate = CrossLayerGate({0: torch.randn(4, 3), 1: torch.randn(4, 3)})
    h = torch.randn(2, 3)
    before = gate.predict(0, h).scores
    gate.observe(1, torch.tensor([[0, 1]]))
    gate.reset()
    assert torch.equal(gate.predict(0, h).scores, before)


# ------------------------------------------------------------------------------------- token popularity
def hand_trace() -> Trace:
    """Vocabulary 6, 4 experts, top-2; MoE layers 0 and 2. Tokens 0, 0, 1, 2, 0."""
    ids0 = torch.tensor([[0, 1], [0, 1], [2, 3], [1, 2], [0, 3]])
    ids2 = torch.tensor([[3, 2], [3, 2], [0, 1], [0, 1], [3, 1]])
    return Trace({}, {0: ids0, 2: ids2}, 4, token_ids=torch.tensor([0, 0, 1, 2, 0]))


def test_token_popularity_table():
    pop = TokenPopularity.from_trace(hand_trace(), vocab_size=6, smoothing=0.0)
    assert pop.targets(EMBEDDING) == (0,)
    assert pop.counts[0, 0].tolist() == [3, 2, 0, 1]  # token 0 was routed to experts 0,1 / 0,1 / 0,3
    pred = pop.predict_from_tokens([0, 1, 2])
    assert pred.layers == (0,) and pred.scores.shape == (1, 3, 4)
    torch.testing.assert_close(pred.scores[0, 0], torch.tensor([3, 2, 0, 1]) / 6.0)
    assert sorted(top(pred, 2, row=1)) == [2, 3] and sorted(top(pred, 2, row=2)) == [1, 2]
    torch.testing.assert_close(pred.scores.sum(-1), torch.ones(1, 3))


def test_token_popularity_falls_back_to_global_popularity():
    pop = TokenPopularity.from_trace(hand_trace(), vocab_size=6, smoothing=1.0)
    glob = torch.tensor([3, 3, 2, 2]) / 10.0  # layer 0: experts 0 and 1 ×3, 2 and 3 ×2
    for unseen in (5, 99, -1):  # never seen, and outside the table
        torch.testing.assert_close(pop.predict_from_tokens([unseen]).scores[0, 0], glob)
    # A seen token is smoothed toward the global distribution by one pseudo-count.
    torch.testing.assert_close(pop.predict_from_tokens([1]).scores[0, 0], (torch.tensor([0, 0, 1, 1]) + glob) / 3)


def test_token_popularity_interface_and_lookahead(tmp_path):
    pop = TokenPopularity.from_trace(hand_trace(), vocab_size=6, lookahead=2)
    ids = torch.tensor([0, 2])
    pred = pop.predict(EMBEDDING, ids)
    assert pred.layers == (0, 2) and torch.equal(pred.scores, pop.predict_from_tokens(ids).scores)
    assert sorted(top(pred, 2, target=1)) == [2, 3]  # token 0 in layer 2: 3,2 / 3,2 / 3,1
    assert pop.predict(0, torch.randn(2, 8)).layers == ()  # only the embedding is a source
    with pytest.raises(TypeError, match="token ids"):
        pop.predict(EMBEDDING, torch.randn(2, 8))
    loaded = TokenPopularity.load(pop.save(tmp_path / "token-popularity.safetensors"))
    assert loaded.moe_layers == [0, 2] and torch.equal(loaded.predict(EMBEDDING, ids).scores, pred.scores)


def test_token_popularity_from_a_model_trace(tmp_path):
    model = load_model(build_tiny_moe(tmp_path / "tiny"))
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 40, (2, 32), generator=gen) for _ in range(4)]  # few distinct tokens: seen often
    trace = collect_traces(model, batches)
    assert torch.equal(trace.token_ids, torch.cat([b.reshape(-1) for b in batches]))
    pop = TokenPopularity.from_trace(trace, model.config.vocab_size)
    (acc,) = evaluate_predictor(pop, trace, sources=[EMBEDDING])
    assert (acc.source, acc.target, acc.tokens) == (EMBEDDING, 0, trace.tokens)
    assert acc.recall[2] > 0.5  # layer 0 routing is close to a function of the token (its embedding)


# -------------------------------------------------------------------------------------- activation path
def test_activation_path_ranks_by_this_requests_counts():
    ap = ActivationPathPredictor([0, 1, 3], num_experts=4, lookahead=2, popularity={1: [0, 5, 1, 9], 3: [7, 0, 0, 1]})
    h = torch.zeros(3, 16)
    fresh = ap.predict(0, h)
    assert fresh.layers == (1, 3) and fresh.scores.shape == (2, 3, 4)
    assert top(fresh, 4) == [3, 1, 2, 0] and top(fresh, 1, target=1) == [0]  # global popularity only
    ap.observe(1, torch.tensor([[2, 0]]))
    ap.observe(1, [2])
    ap.observe(2, [1])  # a dense layer: ignored
    pred = ap.predict(0, h)
    assert top(pred, 4) == [2, 0, 3, 1]  # counts 2 > 1 > 0 = 0, the tie broken by popularity (9 > 5)
    assert torch.equal(pred.scores[:, 0], pred.scores[:, 2])  # same for every token of the step
    torch.testing.assert_close(pred.scores.sum(-1), torch.ones(2, 3))
    assert ap.predict(1, h).layers == (3,) and ap.predict(3, h).layers == ()
    ap.reset()
    assert torch.equal(ap.predict(0, h).scores, fresh.scores)


def test_activation_path_without_popularity_is_uniform_until_observed():
    ap = ActivationPathPredictor([0, 1], num_experts=3)
    torch.testing.assert_close(ap.predict(0, torch.zeros(1, 2)).scores, torch.full((1, 1, 3), 1 / 3))
    ap.observe(1, torch.tensor([[1, 2], [1, 0]]))  # a prefill call: every token counts
    assert top(ap.predict(0, torch.zeros(1, 2)), 1) == [1]


# ------------------------------------------------------------------------------------------------ oracle
CALLS = [(0, [1, 2]), (1, [3, 0]), (3, [2, 5]), (0, [4, 1]), (1, [0, 2]), (3, [7, 6])]  # two decode steps


def test_oracle_replays_the_recorded_experts():
    oracle = OraclePredictor(CALLS, lookahead=2, num_experts=8)
    assert oracle.moe_layers == [0, 1, 3]
    h = torch.zeros(1, 4)
    before = oracle.predict(0, h)  # predicting before observing layer 0 itself
    assert before.layers == (1, 3)
    assert sorted(top(before, 2)) == [0, 3] and sorted(top(before, 2, target=1)) == [2, 5]
    assert before.scores[0, 0].tolist() == [0.5, 0, 0, 0.5, 0, 0, 0, 0]
    oracle.observe(0, [1, 2])
    assert torch.equal(oracle.predict(0, h).scores, before.scores)
    oracle.observe(1, [3, 0])
    after1 = oracle.predict(1, h)
    # Past the last MoE layer the targets run on into the next token's pass: the recording knows it.
    assert after1.layers == (3, 0) and sorted(top(after1, 2)) == [2, 5] and sorted(top(after1, 2, target=1)) == [1, 4]
    oracle.observe(3, [2, 5])
    wrapped = oracle.predict(3, h)
    assert wrapped.layers == (0, 1) and sorted(top(wrapped, 2)) == [1, 4] and sorted(top(wrapped, 2, 1)) == [0, 2]
    second = oracle.predict(0, h)
    assert sorted(top(second, 2)) == [0, 2] and sorted(top(second, 2, target=1)) == [6, 7]
    for layer, ids in CALLS[3:]:
        oracle.observe(layer, ids)
    assert oracle.predict(3, h).layers == ()  # the recorded request is over
    oracle.reset()
    assert torch.equal(oracle.predict(0, h).scores, before.scores)


def test_oracle_multi_token_calls():
    calls = [(0, [[0, 1], [2, 3]]), (1, [[1, 2], [1, 3]])]
    oracle = OraclePredictor(calls, num_experts=4)
    rows = oracle.predict(0, torch.zeros(2, 4))  # rows align with the call's tokens: each its own experts
    assert rows.scores[0].tolist() == [[0, 0.5, 0.5, 0], [0, 0.5, 0, 0.5]]
    counts = oracle.predict(0, torch.zeros(3, 4))  # rows do not align: share of the call's routed slots
    assert counts.topk(3)[0, 2].tolist() == [1, 2, 3]  # expert 1 took 2 slots; 2 and 3 tie: recorded order
    torch.testing.assert_close(counts.scores[0, 2], torch.tensor([0, 2.5, 1.375, 1.125]) / 5)
    assert torch.equal(counts.scores[0, 0], counts.scores[0, 1])


def test_oracle_reads_the_engines_flat_call_lists():
    """The engine records each call as its experts, most used first: a prefill keeps that order."""
    oracle = OraclePredictor([(0, [5, 1, 2, 7]), (1, [3, 0, 6])], [0, 1], lookahead=1, num_experts=8)
    assert oracle.predict(0, torch.zeros(4, 2)).topk(3)[0, 0].tolist() == [3, 0, 6]
    one = OraclePredictor([(0, [5, 1]), (1, [3, 0])])  # decode calls; layers and width inferred
    assert one.moe_layers == [0, 1] and one.num_experts == 6
    assert one.predict(0, torch.zeros(1, 2)).scores[0, 0].tolist() == [0.5, 0, 0, 0.5, 0, 0]


def test_oracle_on_a_recorded_model_run(tmp_path):
    """Record a run with CallRecorder, replay it: every prediction is exactly the next call's experts."""
    model = load_model(build_tiny_moe(tmp_path / "tiny"))
    rec = CallRecorder()
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    model.observers.append(rec)
    cache = model.new_cache()
    model(ids[:, :8], cache)  # prefill, then decode 4 tokens
    for t in range(8, 12):
        model(ids[:, t : t + 1], cache)
    model.observers.remove(rec)
    assert len(rec.calls) == 3 * 5 and [c[0] for c in rec.calls[:3]] == [0, 1, 3]

    oracle = OraclePredictor(rec.calls, model.config.moe_layers, lookahead=1, num_experts=model.config.num_experts)
    predicted: list[tuple[int, Prediction]] = []

    def replay(layer, h, idx, weights):
        predicted.append((layer, oracle.predict(layer, h)))
        oracle.observe(layer, idx)

    model.observers.append(replay)
    cache = model.new_cache()
    model(ids[:, :8], cache)
    for t in range(8, 12):
        model(ids[:, t : t + 1], cache)
    model.observers.remove(replay)
    k = model.config.num_experts_per_tok
    assert predicted[-1][1].layers == ()  # the recorded request is over
    for i, (_, pred) in enumerate(predicted[:-1]):  # layer 3's target: the next token's layer 0
        target, true = rec.calls[i + 1]
        assert pred.layers == (target,)
        got = pred.topk(k)[0].sort(-1).values  # the prompt's rows predict the first token's call alike
        assert torch.equal(got, torch.tensor(true).sort(-1).values.expand_as(got))
