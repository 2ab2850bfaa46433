"""predictors/early_attention.py: layer i+1's attention run one layer early on layer i's residual, on the bundled
(trained) model's held-out text, checked against the layers' real inputs (transformers) and fate-edge's decode."""

import pytest
import torch
from fate_edge.predictors import CrossLayerGate
from fate_edge.predictors.early_attention import early_attention, early_gate_inputs, post_attention_residual
from fate_edge.predictors.evaluate import collect_traces, exact_match
from transformers import AutoModelForCausalLM

from fate_edge.model.layer import apply_linear, rms_norm
from fate_edge.planning.calibrate import CalibrateOptions, corpus_windows, separator_id

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def text(bundled_model, bundled_dir, bundled_tokenizer):
    """Eight held-out windows: their ids, trace, and every layer's input before attention (transformers)."""
    sep = separator_id(bundled_tokenizer, bundled_model.config)
    _, held, _ = corpus_windows(bundled_dir, bundled_tokenizer, sep, CalibrateOptions(tokens=40000))
    ids = held[:8]
    trace = collect_traces(bundled_model, ids.split(4))
    hf = AutoModelForCausalLM.from_pretrained(bundled_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        states = hf(input_ids=ids, output_hidden_states=True).hidden_states
    inputs = {j: states[j].reshape(-1, states[j].shape[-1]) for j in range(bundled_model.config.num_hidden_layers)}
    return ids, trace, inputs


def test_given_the_true_input_it_is_the_layers_gate_input(bundled_model, text):
    """Nothing estimated (the layer's real input as the residual): s is exactly the gate input the router reads,
    and the post-attention residual normed is the source layer's gate input."""
    ids, trace, x = text
    seq = ids.shape[1]
    moe = bundled_model.config.moe_layers
    for j in moe[1:]:
        s = early_attention(bundled_model, x[j], x[j], j, seq)
        torch.testing.assert_close(s, trace.gate_inputs[j].float(), atol=2e-4, rtol=1e-4)
        assert exact_match(bundled_model.route(j, s)[1], trace.expert_ids[j]) > 0.999
    r = post_attention_residual(bundled_model, x[moe[0]], moe[0], seq)
    post = bundled_model.plan()[moe[0]].post_norm
    torch.testing.assert_close(
        rms_norm(r, post, bundled_model.config.rms_norm_eps), trace.gate_inputs[moe[0]].float(), atol=2e-4, rtol=1e-4
    )


def test_each_row_is_what_a_decode_step_would_compute(bundled_model, text):
    """Row t reads the true keys and values of positions < t (the KV cache a decode step has) and its own
    estimated ones: the same as fate-edge's attention for one token continuing a cache filled by a real prefill."""
    model, (ids, _, x) = bundled_model, text
    seq, cfg = ids.shape[1], bundled_model.config
    source, target, t = cfg.moe_layers[1], cfg.moe_layers[2], 37
    r = post_attention_residual(model, x[source], source, seq)
    s = early_attention(model, r, x[target], target, seq)
    cache = model.new_cache()
    with torch.no_grad():
        model(ids[:1, :t], cache)
        lp = model.plan()[target]
        cos, sin = model.rope.cos_sin_range(t, 1, torch.float32)
        q, k, v = model.gqa_qkv(rms_norm(r[t : t + 1], lp.input_norm, cfg.rms_norm_eps), 1, 1, cos, sin, lp)
        keys, values = cache.layers[target].append(k, v)
        a = apply_linear(model._attend(q, keys, values, t, target, cfg.head_dim**-0.5), lp.o_proj)
        want = rms_norm(r[t : t + 1] + a, lp.post_norm, cfg.rms_norm_eps)
    torch.testing.assert_close(s[t : t + 1], want, atol=2e-4, rtol=1e-4)


def test_the_next_router_on_it_beats_the_cross_layer_gate(bundled_model, text):
    """What the early attention is for: untrained, the next layer's router on s finds the next layer's experts
    more often than the cross-layer gate on layer i's gate input (Fate's predictor), on held-out text."""
    ids, trace, x = text
    s = early_gate_inputs(bundled_model, x, ids.shape[1])
    gate = CrossLayerGate.from_model(bundled_model, 1, norm_variant=True)
    early, fate = [], []
    for i, si in s.items():
        true = trace.expert_ids[i + 1]
        early.append(exact_match(bundled_model.route(i + 1, si)[1], true))
        fate.append(exact_match(gate.predict(i, trace.gate_inputs[i]).topk(true.shape[1])[0], true))
    assert len(early) == len(bundled_model.config.moe_layers) - 1
    assert sum(early) / len(early) > sum(fate) / len(fate) + 0.05, (early, fate)
