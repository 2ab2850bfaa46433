"""Compiled decode (fate_edge.model.compiled_step): the eager fast path's tokens and logits from one graph per token.

Compiling costs ~40 s per model cold on this host (a few seconds once inductor's disk cache holds the kernels),
so two models compile here: the bundled model with int4 experts (the benchmark's int4 side) and the tiny
qwen2_moe test model (float experts, a dense layer). Fallbacks are tested without compiling."""

import warnings

import pytest
import torch
from _tiny_moe import build_tiny_moe
from test_decode_step import store_int4_model

from fate_edge import load_model
from fate_edge.fetch.store_provider import StoreExpertProvider
from fate_edge.format.store import ExpertStore
from fate_edge.model.compiled_step import unsupported
from fate_edge.model.experts import InMemoryExpertProvider

STEPS = 20  # the cache grows past its first capacity (64) on the way: the compiled length is dynamic


def greedy(model, prompt: torch.Tensor, steps: int = STEPS) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Greedy decode after ``prompt``: (tokens, logits [steps, V], routing seen by an observer)."""
    seen = []
    model.observers[:] = [lambda layer, h, idx, w: seen.append((layer, idx.tolist(), w.clone()))]
    cache = model.new_cache()
    toks, logits = [], []
    with torch.inference_mode():
        tok = model(prompt, cache, last_only=True)[0, -1].argmax().view(1, 1)
        for _ in range(steps):
            out = model(tok, cache)[0, -1]
            logits.append(out)
            tok = out.argmax().view(1, 1)
            toks.append(int(tok))
    model.observers.clear()
    return torch.tensor(toks), torch.stack(logits), seen


def assert_compiled_matches_eager(model, prompt: torch.Tensor, rel: float) -> None:
    eager = greedy(model, prompt)
    assert model.set_compile("on") is None, model.runner.failed
    calls = []
    fn = model.runner.fn
    model.runner.fn = lambda *a: calls.append(1) or fn(*a)  # count compiled steps: no silent eager fallback
    compiled = greedy(model, prompt)
    assert len(calls) == STEPS and model.runner.failed is None
    assert torch.equal(compiled[0], eager[0])  # same greedy tokens
    assert ((compiled[1] - eager[1]).norm() / eager[1].norm()).item() < rel
    assert [(layer, ids) for layer, ids, _ in compiled[2]] == [(layer, ids) for layer, ids, _ in eager[2]]
    model.set_compile("off")
    assert torch.equal(greedy(model, prompt)[1], eager[1])  # off is the eager path again


@pytest.mark.slow
def test_bundled_int4_compiled_decode_matches_eager(bundled_dir, one_thread):
    model = store_int4_model(bundled_dir)
    prompt = torch.randint(0, model.config.vocab_size, (1, 60), generator=torch.Generator().manual_seed(0))
    # The eager int4 path rounds the same bf16 kernels; the graph fuses the fp32 ops around them differently.
    assert_compiled_matches_eager(model, prompt, rel=1e-2)


@pytest.mark.slow
def test_tiny_float_experts_with_a_dense_layer_compiled_decode_matches_eager(tmp_path, one_thread):
    model = load_model(build_tiny_moe(tmp_path / "tiny"))
    assert not model.config.is_moe_layer(2)
    prompt = torch.randint(0, model.config.vocab_size, (1, 50), generator=torch.Generator().manual_seed(1))
    assert_compiled_matches_eager(model, prompt, rel=1e-4)  # fp32 throughout: rounding only


def test_streamed_experts_stay_eager(baseline_store, one_thread):
    store = baseline_store  # float resident weights: streaming is what keeps it eager
    model = load_model(store, torch.float32, experts=StoreExpertProvider(ExpertStore(store), bits=4))
    try:
        assert "streamed" in unsupported(model)
        assert "streamed" in model.set_compile("auto") and model.runner is None  # auto: silently eager
        with pytest.warns(UserWarning, match="decoding eagerly"):
            model.set_compile("on")
    finally:
        model.experts.close()


def test_a_failing_compile_falls_back_to_eager_for_good(bundled_dir, one_thread):
    model = load_model(bundled_dir)
    assert isinstance(model.experts, InMemoryExpertProvider)
    prompt = torch.tensor([[5, 300, 17, 2048, 99]])
    eager = greedy(model, prompt, steps=3)
    assert model.set_compile("auto", warm=False) is None

    def broken(*args):
        raise RuntimeError("C++ compile failed")

    model.runner.fn = broken
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # auto: no warning, one line on stderr
        fallback = greedy(model, prompt, steps=3)
    assert "C++ compile failed" in model.runner.failed
    assert torch.equal(fallback[1], eager[1])
