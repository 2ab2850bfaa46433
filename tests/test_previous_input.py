"""predictors/previous_input.py: learned predictors that also read the previous token's next-layer gate input,
trained by ``fate-edge calibrate --previous-input`` and fed by the scheduler in decode."""

import dataclasses
import json

import pytest
import torch
from _calibrated import calibrated_bundled_copy, spy_model_inputs
from _tiny_moe import build_tiny_moe
from fate_edge.predictors import CrossLayerGate, LearnedPredictor, OnnxPredictor, train_learned
from fate_edge.predictors.evaluate import TraceRecorder, collect_traces, evaluate_predictor
from fate_edge.predictors.learned import TrainConfig
from fate_edge.predictors.previous_input import PreviousInput, previous_rows, widen_trace

from fate_edge import Engine, GenerateConfig
from fate_edge.runtime.loader import load_model
from fate_edge.runtime.policy import get_policy

pytestmark = pytest.mark.usefixtures("one_thread")
SEQ = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_moe(tmp_path_factory.mktemp("tiny-moe"))  # MoE layers 0, 1, 3; layer 2 dense


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir)


@pytest.fixture(scope="module")
def trace(model):
    gen = torch.Generator().manual_seed(0)
    return collect_traces(model, [torch.randint(0, model.config.vocab_size, (4, SEQ), generator=gen) for _ in range(4)])


@pytest.fixture(scope="module")
def trained(model, trace):
    gate = CrossLayerGate.from_model(model, lookahead=2)
    cfg = TrainConfig(kind="lowrank", rank=8, epochs=3, previous_input=True)
    return train_learned(gate, widen_trace(trace, model.config.moe_layers, SEQ), config=cfg, progress=False)


def test_previous_rows_stay_inside_a_window():
    x = torch.arange(12.0).view(6, 2)  # two windows of 3 positions
    shifted = previous_rows(x, 3)
    assert shifted[[0, 3]].eq(0).all() and torch.equal(shifted[[1, 2, 4, 5]], x[[0, 1, 3, 4]])


def test_widened_trace_pairs_each_layer_with_the_next_moe_layer_one_row_down(model, trace):
    wide = widen_trace(trace, model.config.moe_layers, SEQ)
    assert sorted(wide.gate_inputs) == [0, 1]  # the last MoE layer predicts nothing
    hidden = model.config.hidden_size
    assert torch.equal(wide.gate_inputs[1][:, :hidden], trace.gate_inputs[1])
    assert torch.equal(wide.gate_inputs[1][1:SEQ, hidden:], trace.gate_inputs[3][: SEQ - 1])  # layer 2 is dense
    assert wide.gate_inputs[1][SEQ, hidden:].eq(0).all()  # a window's first token has no previous one


def test_a_widened_trace_sliced_holds_the_rows_of_the_whole_widened_one(model, trace):
    """Trace.rows on a widened trace builds only the asked rows (calibrate's validation tail, nested slices, a
    cut inside a window): each must equal the same rows of the whole trace widened at once."""
    half = {i: h.half() for i, h in trace.gate_inputs.items()}  # as calibrate keeps them
    early = {i: torch.randn(trace.tokens, model.config.hidden_size).half() for i in (0, 1)}
    narrow = dataclasses.replace(trace, gate_inputs=half, early_inputs=early)
    wide = widen_trace(narrow, model.config.moe_layers, SEQ, previous=True, early=True)
    whole = {i: wide.gate_inputs[i] for i in wide.gate_inputs}
    assert all(
        h.dtype == torch.float32 and h.shape == (trace.tokens, 3 * model.config.hidden_size) for h in whole.values()
    )
    for start, stop in [(0, None), (SEQ + 5, 3 * SEQ - 2), (-SEQ - 3, None), (7, 7)]:
        part = wide.rows(start, stop)
        assert sorted(part.gate_inputs) == [0, 1]
        for i in (0, 1):
            assert torch.equal(part.gate_inputs[i], whole[i][start:stop])
            assert torch.equal(part.expert_ids[i], trace.expert_ids[i][start:stop])
    nested = wide.rows(SEQ - 4, None).rows(2, SEQ + 1)  # rows SEQ-2 .. 2·SEQ-4, across a window's start
    assert torch.equal(nested.gate_inputs[1], whole[1][SEQ - 2 : 2 * SEQ - 3])


def test_a_half_precision_trace_trains_the_predictor_a_float32_one_does(model, trace):
    """calibrate keeps its traces in float16: the predictor trained on them, and its held-out score, match the
    float32 trace's to the rounding."""
    half = dataclasses.replace(trace, gate_inputs={i: h.half() for i, h in trace.gate_inputs.items()})
    gate = CrossLayerGate.from_model(model, lookahead=1)
    cfg = TrainConfig(kind="lowrank", rank=8, epochs=2, previous_input=True)
    moe = model.config.moe_layers
    full, rounded = (train_learned(gate, widen_trace(t, moe, SEQ), config=cfg, progress=False) for t in (trace, half))
    h = widen_trace(trace, moe, SEQ).gate_inputs[0]
    torch.testing.assert_close(rounded.predict(0, h).scores, full.predict(0, h).scores, atol=2e-2, rtol=2e-2)
    scores = [
        evaluate_predictor(p, widen_trace(t, moe, SEQ), [2])[0].exact for p, t in ((full, trace), (rounded, half))
    ]
    assert abs(scores[0] - scores[1]) < 0.02


@pytest.mark.parametrize("kind", ["linear", "lowrank"])
def test_untrained_it_is_the_cross_layer_gate_whatever_the_previous_input(model, kind):
    gate = CrossLayerGate.from_model(model, lookahead=2, norm_variant=True)
    learned = LearnedPredictor.from_gate(gate, kind=kind, rank=8, previous=True)
    h = torch.randn(5, model.config.hidden_size)
    learned.observe_input(1, 10 * torch.randn(1, model.config.hidden_size))
    for layer in (0, 1):
        want = gate.predict(layer, h)
        torch.testing.assert_close(learned.predict(layer, h).scores, want.scores, atol=1e-6, rtol=1e-5)
        wide = torch.cat([h, 10 * torch.randn_like(h)], 1)  # a trace's widened rows pass as they are
        torch.testing.assert_close(learned.predict(layer, wide).scores, want.scores, atol=1e-6, rtol=1e-5)


def test_training_a_narrow_trace_for_the_previous_input_is_refused(model, trace):
    gate = CrossLayerGate.from_model(model, lookahead=1)
    with pytest.raises(ValueError, match="widen_trace"):
        train_learned(gate, trace, config=TrainConfig(rank=8, epochs=1, previous_input=True), progress=False)


def test_state_gives_the_first_row_the_next_layers_latest_input_and_later_rows_zeros():
    ctx = PreviousInput([0, 1, 3])
    h1, h3 = torch.randn(4, 6), torch.randn(1, 6)
    ctx.observe(1, h1)
    ctx.observe(3, h3)
    wide = ctx.widen(1, torch.ones(3, 6))  # layer 1's next MoE layer is 3
    assert torch.equal(wide[0, 6:], h3[0]) and wide[1:, 6:].eq(0).all() and wide[:, :6].eq(1).all()
    assert torch.equal(ctx.widen(0, torch.ones(1, 6))[0, 6:], h1[-1])  # a prompt's last row is the previous token
    ctx.reset()
    assert ctx.widen(1, torch.ones(1, 6))[:, 6:].eq(0).all()


def test_save_load_and_onnx_keep_the_previous_input(model, tmp_path):
    trained = LearnedPredictor.from_gate(CrossLayerGate.from_model(model, lookahead=2), "lowrank", 8, previous=True)
    with torch.no_grad():  # as if trained: every weight, the previous input's included, counts
        for param in (q for m in trained.models.values() for q in m.parameters()):
            param.normal_(0, 0.3, generator=torch.Generator().manual_seed(param.numel()))
    path = trained.save(tmp_path)
    manifest = json.loads(path.read_text())
    hidden = model.config.hidden_size
    assert manifest["previous_input"] is True and manifest["version"] == 2 and manifest["hidden_size"] == hidden
    loaded, onnx = LearnedPredictor.load(path), OnnxPredictor(path)
    h, prev = torch.randn(3, hidden), torch.randn(1, hidden)
    for p in (trained, loaded, onnx):
        p.reset()
        p.observe_input(3, prev)
    want = trained.predict(1, h).scores
    assert not torch.allclose(want, trained.predict(1, torch.cat([h, torch.zeros_like(h)], 1)).scores, atol=1e-4)
    torch.testing.assert_close(loaded.predict(1, h).scores, want)
    torch.testing.assert_close(onnx.predict(1, h).scores, want, atol=1e-5, rtol=1e-4)


def test_the_engine_predicts_from_the_previous_tokens_next_layer_input(bundled_dir, tmp_path, monkeypatch):
    """calibrate --previous-input → the engine's learned predictor reads, at each decode layer call, exactly the
    previous token's gate input of the layer it predicts (what the calibration trained it on)."""
    model_dir, report = calibrated_bundled_copy(bundled_dir, tmp_path, monkeypatch, previous_input=True)
    assert report["previous_input"] is True
    policy = dataclasses.replace(get_policy("fate-edge"), predictor="learned", prefetch_gate=False)
    # a budget that does not hold the model: one that does leaves nothing to predict (the scheduler then skips it)
    with Engine.load(model_dir, "3MB", policy=policy) as engine:
        assert not engine.scheduler.all_at_hand
        predictor = engine.scheduler.predictor
        assert isinstance(predictor, LearnedPredictor) and predictor.context is not None
        seen = spy_model_inputs(predictor, monkeypatch)
        rec = TraceRecorder(engine.model.config.num_experts)
        engine.model.observers.insert(0, rec)
        engine.generate_text("def add(a, b):", GenerateConfig(max_tokens=6, ignore_eos=True))
        engine.model.observers.remove(rec)
        layers, hidden = engine.model.config.moe_layers, engine.model.config.hidden_size
    inputs = rec.trace().gate_inputs  # per layer: the prompt's rows routed there, then one row per decode token
    decode = [(layer, x) for layer, x in seen if x.shape[0] == 1]
    assert [layer for layer, _ in decode] == layers[:-1] * 5  # 5 decode forwards; the last MoE layer has no target
    for n, (layer, x) in enumerate(decode):
        nxt, step = layers[layers.index(layer) + 1], n // (len(layers) - 1)
        torch.testing.assert_close(x[0, :hidden], inputs[layer][step - 5])  # this token's own gate input
        torch.testing.assert_close(x[0, hidden:], inputs[nxt][step - 6])  # the previous token's, at the target
