"""A decode row's attention block as direct native calls (``fate_edge.model.attention_row``): taken where its
projections are native int4, with the general path's bits (logits and the cache it writes); left to the general
path where the layer, the row or the cache is one it does not take."""

from __future__ import annotations

import pytest
import torch
from fate_edge.quant.native import native_status

from fate_edge import load_model
from fate_edge.model import attention_row, row_ops
from fate_edge.model.decode_layer import DecodeLayers
from fate_edge.model.layer import Fused

pytestmark = pytest.mark.skipif(
    not (native_status()[0] and row_ops.available()[0]), reason="needs the native int4 and row kernels"
)


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    from _tiny_moe import build_wide_moe

    return build_wide_moe(tmp_path_factory.mktemp("wide") / "m", 128, vocab=1024)


def _model(wide_dir):
    return load_model(wide_dir, torch.bfloat16, resident_bits=4)  # q/k/v (with its bias) and o on native int4


def _decode(model, steps: int = 5):
    cache = model.new_cache()  # no capacity hint: the first buffers hold 64 positions
    out = []
    with torch.inference_mode():
        tok = model(torch.tensor([[3, 17, 99, 5, 250, 7]]), cache)[0, -1].argmax().view(1, 1)
        for _ in range(steps):
            logits = model(tok, cache)
            out.append(logits)
            tok = logits[0, -1].argmax().view(1, 1)
    return torch.cat(out, dim=1), cache


def _counting(monkeypatch) -> list[bool]:
    taken: list[bool] = []
    real = attention_row.attend

    def counted(*args):
        y = real(*args)
        taken.append(y is not None)
        return y

    monkeypatch.setattr(attention_row, "attend", counted)
    return taken


@pytest.mark.parametrize("threads", [1, 2])
def test_a_decode_row_takes_the_native_block_with_the_general_paths_bits(wide_dir, monkeypatch, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = _model(wide_dir)
        plan = attention_row.plan_of(model.config, model.plan()[0])
        assert plan is not None and plan.bias is not None and (plan.n_q, plan.n_k) == (2, 1)  # GQA, a q/k/v bias
        taken = _counting(monkeypatch)
        logits, cache = _decode(model)
        layers = model.config.num_hidden_layers
        assert taken == [True] * (5 * layers)
        monkeypatch.setattr(attention_row, "attend", lambda *args: None)
        want, want_cache = _decode(_model(wide_dir))
        assert torch.equal(logits, want)
        for lay, ref in zip(cache.layers, want_cache.layers):  # the keys and values it wrote, position by position
            assert lay.length == ref.length
            for b, r in zip(lay.buffers, ref.buffers):
                assert torch.equal(b.narrow(2, 0, lay.length), r.narrow(2, 0, ref.length))
    finally:
        torch.set_num_threads(before)


def test_qwen3s_per_head_q_and_k_norms_are_taken_with_the_general_paths_bits(tmp_path, monkeypatch):
    """Each head of q and k normed by its weight before rope, natively (``row_ops.head_norm_at``) and through torch's
    rms_norm in the general path: the same logits and cache."""
    from _tiny_moe import build_wide_qwen3

    qwen3 = build_wide_qwen3(tmp_path / "q3", 128, vocab=1024)
    model = load_model(qwen3, torch.bfloat16, resident_bits=4)
    plan = attention_row.plan_of(model.config, model.plan()[0])
    assert plan is not None and plan.q_norm is not None and plan.bias is None and plan.head_dim == 64
    taken = _counting(monkeypatch)
    logits, cache = _decode(model)
    assert taken == [True] * (5 * model.config.num_hidden_layers)
    monkeypatch.setattr(attention_row, "attend", lambda *args: None)
    want, want_cache = _decode(load_model(qwen3, torch.bfloat16, resident_bits=4))
    assert torch.equal(logits, want)
    for lay, ref in zip(cache.layers, want_cache.layers):
        for b, r in zip(lay.buffers, ref.buffers):
            assert torch.equal(b.narrow(2, 0, lay.length), r.narrow(2, 0, ref.length))


def test_a_full_cache_goes_to_the_general_path_which_grows_it(wide_dir, monkeypatch):
    model = _model(wide_dir)
    taken = _counting(monkeypatch)
    first, _ = _decode(model, steps=70)  # the first buffers hold 64 positions: the general path grows them once
    layers = model.config.num_hidden_layers
    assert taken.count(False) == layers and len(taken) == 70 * layers
    monkeypatch.setattr(attention_row, "attend", lambda *args: None)
    want, _ = _decode(_model(wide_dir), steps=70)
    assert torch.equal(first, want)


def test_layers_it_does_not_take_are_planned_as_none(wide_dir):
    model = _model(wide_dir)
    cfg, lp = model.config, model.plan()[0]
    assert attention_row.plan_of(cfg, lp) is not None
    qkv = lp.qkv
    assert qkv is not None
    lp.qkv = Fused(qkv.weight, qkv.bias.float(), qkv.sizes)  # a float32 bias: the projection's output is float32
    assert attention_row.plan_of(cfg, lp) is None
    lp.qkv = Fused(qkv.weight, qkv.bias, qkv.sizes)  # a new projection object: planned again
    assert attention_row.plan_of(cfg, lp) is not None
    plain = load_model(wide_dir, torch.bfloat16)  # the same checkpoint, its projections bf16 on torch's matmul
    assert attention_row.plan_of(plain.config, plain.plan()[0]) is None


def test_an_engine_gives_the_same_tokens_and_logprobs_with_and_without_it(tmp_path, wide_dir, monkeypatch):
    from fate_edge.format.convert import convert
    from fate_edge.runtime.engine import Engine
    from fate_edge.runtime.engine_config import EngineConfig
    from fate_edge.runtime.generate import GenerateConfig

    store = convert(wide_dir, tmp_path / "s", progress=False)
    cfg = GenerateConfig(max_tokens=10, ignore_eos=True, logprobs=3)
    prompt = [3, 17, 99, 5, 250, 7, 64, 12]
    # the engine's resident layers run whole in one call (decode_layer, tests/test_decode_layer.py): this is the
    # path beside it, a layer's attention block taken on its own
    monkeypatch.setattr(DecodeLayers, "of", staticmethod(lambda *args: None))
    taken = _counting(monkeypatch)
    with Engine(EngineConfig(store, "auto", dtype="bfloat16")) as engine:
        native = [(r.token, r.logprob) for r in engine.stream(prompt, cfg)]
    assert taken and all(taken)
    monkeypatch.setattr(attention_row, "attend", lambda *args: None)
    with Engine(EngineConfig(store, "auto", dtype="bfloat16")) as engine:
        general = [(r.token, r.logprob) for r in engine.stream(prompt, cfg)]
    assert native == general


def test_rows_it_does_not_take_are_left_untouched(wide_dir):
    """A float32 residual, two rows, a float32 row: None, and the cache is not written."""
    from fate_edge.model.row_ops import RopeRows

    model = _model(wide_dir)
    cache = model.new_cache()
    with torch.inference_mode():
        model(torch.tensor([[3, 17, 99, 5]]), cache)
    cfg, lp = model.config, model.plan()[0]
    x = torch.randn(1, cfg.hidden_size).bfloat16()
    h = torch.randn(1, cfg.hidden_size).bfloat16()
    cos, sin = model.rope.cos_sin_range(cache.length, 1, torch.bfloat16, x.device)
    rot = RopeRows.of(x, cos, sin)
    assert rot is not None
    before = [b.clone() for b in cache.layers[0].buffers]
    assert attention_row.attend(cfg, x.float(), h, 0, lp, cache, rot) is None
    assert attention_row.attend(cfg, x, h.expand(2, -1).contiguous(), 0, lp, cache, rot) is None
    assert attention_row.attend(cfg, x, h.float(), 0, lp, cache, rot) is None
    assert cache.layers[0].length == 4
    assert all(torch.equal(a, b) for a, b in zip(before, cache.layers[0].buffers))
    y = attention_row.attend(cfg, x, h, 0, lp, cache, rot)  # the row it takes: written at position 4
    assert y is not None and cache.layers[0].length == 5
