"""The early attention in the engine: the decode step's estimate (EarlyInput) is the row the calibration traced,
predictors calibrated with ``--early-attention`` save, load and run it, and the engine feeds it while decoding."""

import dataclasses
import json

import pytest
import torch
from _calibrated import calibrated_baseline_store, calibrated_bundled_copy, spy_model_inputs
from _tiny_moe import build_tiny_moe
from fate_edge.predictors import CrossLayerGate, LearnedPredictor, OnnxPredictor
from fate_edge.predictors.early_attention import EarlyInput
from fate_edge.predictors.evaluate import collect_traces
from fate_edge.predictors.learned import TrainConfig, train_learned
from fate_edge.predictors.previous_input import widen_trace

from fate_edge import Engine, GenerateConfig
from fate_edge.runtime.loader import load_model
from fate_edge.runtime.policy import get_policy

pytestmark = pytest.mark.usefixtures("one_thread")
SEQ = 24


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(build_tiny_moe(tmp_path_factory.mktemp("tiny-moe")))  # MoE layers 0, 1, 3; layer 2 dense


@pytest.fixture(scope="module")
def ids(model):
    return torch.randint(0, model.config.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("fast_decode", [True, False])
def test_a_decode_step_estimates_the_row_the_trace_recorded(model, ids, fast_decode, monkeypatch):
    """Prefill t tokens, decode token t: at each MoE layer EarlyInput gives exactly the trace's early input of row
    t (true keys/values of the earlier rows, its own estimated), through either decode path; layer 1's target is
    layer 3, past the dense layer 2."""
    trace = collect_traces(model, [ids], early=True)
    assert sorted(trace.early_inputs) == [0, 1]
    early, got = EarlyInput(model), {}

    def observe(layer, h, idx, weights):
        if h.shape[0] == 1 and layer in early.next:
            got[layer] = early.estimate(layer, h)

    monkeypatch.setattr(model, "fast_decode", fast_decode)
    for t in (1, 9, SEQ - 1):
        got.clear()
        cache = model.new_cache()
        with torch.no_grad():
            model(ids[:, :t], cache)
            model.observers.append(observe)
            try:
                model(ids[:, t : t + 1], cache)
            finally:
                model.observers.remove(observe)
        assert sorted(got) == [0, 1]
        for layer, s in got.items():
            torch.testing.assert_close(s[0], trace.early_inputs[layer][t], atol=1e-5, rtol=1e-4)


def test_without_a_residual_it_reads_zeros_and_an_unattached_predictor_refuses(model):
    early = EarlyInput(model)
    model.residual = None
    assert early.estimate(0, torch.ones(1, model.config.hidden_size)).eq(0).all()
    pred = LearnedPredictor.from_gate(CrossLayerGate.from_model(model, lookahead=1), "lowrank", 8, early=True)
    with pytest.raises(RuntimeError, match="attach"):
        pred.predict(0, torch.ones(1, model.config.hidden_size))


@pytest.mark.slow
def test_training_on_it_and_save_load_onnx_keep_it(model, ids, tmp_path):
    """train_learned on a trace widened with the early inputs; the manifest says so (version 3); the loaded and
    ONNX predictors, attached to the model, score a decode step exactly as the trained one."""
    gen = torch.Generator().manual_seed(0)
    trace = collect_traces(model, [torch.randint(0, model.config.vocab_size, (4, SEQ), generator=gen)], early=True)
    wide = widen_trace(trace, model.config.moe_layers, SEQ, previous=True, early=True)
    hidden = model.config.hidden_size
    assert wide.gate_inputs[0].shape[1] == 3 * hidden  # [h, early, previous]
    cfg = TrainConfig(kind="lowrank", rank=8, epochs=2, previous_input=True, early_attention=True)
    trained = train_learned(CrossLayerGate.from_model(model, lookahead=1), wide, config=cfg, progress=False)
    with torch.no_grad():  # as if trained longer: every weight, the early input's included, counts
        for param in (q for m in trained.models.values() for q in m.parameters()):
            param.normal_(0, 0.3, generator=torch.Generator().manual_seed(param.numel()))
    path = trained.save(tmp_path)
    manifest = json.loads(path.read_text())
    assert manifest["early_attention"] is True and manifest["previous_input"] is True and manifest["version"] == 3
    loaded, onnx = LearnedPredictor.load(path), OnnxPredictor(path)
    for p in (trained, loaded, onnx):
        p.attach(model)
    got: dict[str, torch.Tensor] = {}

    def observe(layer, h, idx, weights):
        if layer == 1 and h.shape[0] == 1:
            for name, p in (("trained", trained), ("loaded", loaded), ("onnx", onnx)):
                got[name] = p.predict(1, h).scores
            got["no early"] = trained.predict(1, torch.cat([h, torch.zeros(1, 2 * hidden)], 1)).scores

    cache = model.new_cache()
    with torch.no_grad():
        model(ids[:, :10], cache)
        model.observers.append(observe)
        try:
            model(ids[:, 10:11], cache)
        finally:
            model.observers.remove(observe)
    assert not torch.allclose(got["trained"], got["no early"], atol=1e-4)
    torch.testing.assert_close(got["loaded"], got["trained"])
    torch.testing.assert_close(got["onnx"], got["trained"], atol=1e-5, rtol=1e-4)


def test_the_engine_predicts_from_the_early_attention(bundled_dir, tmp_path, monkeypatch):
    """calibrate --early-attention → the engine attaches its model to the learned predictor, which reads at each
    decode layer call [h, s] with s the early attention's estimate for that token: the row a teacher-forced trace
    of the same tokens records."""
    model_dir, report = calibrated_bundled_copy(bundled_dir, tmp_path, monkeypatch, early_attention=True)
    assert report["early_attention"] is True and report["predictors"]["learned-lowrank"]["rows"]
    # bf16 experts: the decode step and the teacher-forced prefill then compute the same numbers (int4 kernels
    # quantise activations differently for one row and for many)
    policy = dataclasses.replace(get_policy("fate-edge"), predictor="learned", prefetch_gate=False, bits=16)
    prompt = [11, 42, 7, 99, 3]
    store = calibrated_baseline_store(model_dir)  # the bf16 copy, asked for
    # a budget that does not hold the model: one that does leaves nothing to predict (the scheduler then skips it)
    with Engine.load(store, "8MB", policy=policy) as engine:
        assert not engine.scheduler.all_at_hand
        predictor = engine.scheduler.predictor
        assert isinstance(predictor, LearnedPredictor) and predictor.early is not None
        seen = spy_model_inputs(predictor, monkeypatch)
        tokens = [r.token for r in engine.stream(prompt, GenerateConfig(max_tokens=6, ignore_eos=True))]
        assert engine.scheduler.stats.predictions > 0
        layers, hidden = engine.model.config.moe_layers, engine.model.config.hidden_size
        engine.model.observers.clear()  # the teacher-forced trace below runs the model alone
        trace = collect_traces(engine.model, [torch.tensor([prompt + tokens[:5]])], early=True)
    decode = [(layer, x) for layer, x in seen if x.shape[0] == 1]
    assert [layer for layer, _ in decode] == layers[:-1] * 5  # 5 decode forwards; the last MoE layer has no target
    for n, (layer, x) in enumerate(decode):
        position = len(prompt) + n // (len(layers) - 1)
        torch.testing.assert_close(x[0, :hidden], trace.gate_inputs[layer][position])
        torch.testing.assert_close(x[0, hidden:], trace.early_inputs[layer][position], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_the_planner_scores_an_early_attention_predictor(bundled_dir, tmp_path, monkeypatch):
    """The planner's traces carry the early attention's estimate when the store's predictor reads it: the
    teacher-forced trace scores the learned predictor on [h, s] rows (as predicting the traced rows does), and
    the engine probe records each decode step's estimate."""
    from fate_edge.predictors.learned import find_learned

    from fate_edge.planning.host_costs import probe_engine
    from fate_edge.planning.plan_trace import record_plan_trace, trace_predictions

    model_dir, _ = calibrated_bundled_copy(bundled_dir, tmp_path, monkeypatch, early_attention=True)
    store = calibrated_baseline_store(model_dir)
    model = load_model(model_dir)
    ids = [(7 * i + 3) % model.config.vocab_size for i in range(40)]
    plan = record_plan_trace(model, ids, lookahead=1, store_dir=store)
    assert plan.predictions["best-available"] is plan.predictions["learned"]
    trace = collect_traces(model, [torch.tensor([ids])], early=True)
    wide = widen_trace(trace, model.config.moe_layers, len(ids), previous=False, early=True)
    learned = LearnedPredictor.load(find_learned(store / "predictors", widest=True))
    src, target = model.config.moe_layers[0], model.config.moe_layers[1]
    torch.testing.assert_close(
        plan.predictions["learned"][(src, target)], learned.predict(src, wide.gate_inputs[src]).for_layer(target)
    )
    with pytest.raises(ValueError, match="early attention"):
        trace_predictions(model, trace.expert_ids, trace.gate_inputs, 1, store)
    policy = dataclasses.replace(get_policy("fate-edge"), predictor="learned", prefetch_gate=False, bits=16)
    run = probe_engine(store, 64 << 20, policy, None, ids[:8], torch.float32, tokens=4, record=True)
    assert run.trace is not None and "learned" in run.trace.predictions
    assert run.trace.predictions["learned"][(src, target)].shape[0] == run.trace.expert_ids[src].shape[0] >= 4
