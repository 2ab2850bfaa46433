"""The one-graph decode step (``compiled_step.step_graph``), as the CUDA graph replays it, checked on the CPU.

``CudaGraphDecode(model, capture=False)`` runs the captured step's code without capturing: static KV buffers the
request's cache is re-pointed at, capacity grown by reallocation, the position and rope rows copied in each step.
The CUDA side (capture and replay) runs in tests/test_gpu.py where a GPU is."""

import pytest
import torch
from _tiny_moe import build_tiny_moe
from test_compiled_step import greedy

from fate_edge import load_model
from fate_edge.model import compiled_step
from fate_edge.model.graph_step import MIN_CAPACITY, CudaGraphDecode, LayerGraphDecode, unsupported

STEPS = 12


@pytest.fixture(scope="module")
def top4_model(tmp_path_factory):
    return load_model(build_tiny_moe(tmp_path_factory.mktemp("top4") / "m", top_k=4, expert_dim=32))


@pytest.mark.parametrize("step", [CudaGraphDecode, LayerGraphDecode])
def test_static_steps_give_the_eager_tokens_on_a_top4_model_with_a_dense_layer(top4_model, step, one_thread):
    """The whole-step and the per-layer static steps (the latter with experts from the provider between layers)."""
    model = top4_model
    assert not model.config.is_moe_layer(2)
    prompt = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    eager = greedy(model, prompt, STEPS)
    model.compiled = step(model, capture=False)
    try:
        static = greedy(model, prompt, STEPS)
    finally:
        model.compiled = None
    assert torch.equal(static[0], eager[0])
    assert ((static[1] - eager[1]).norm() / eager[1].norm()).item() < 1e-5  # fp32: rounding only
    assert [(layer, ids) for layer, ids, _ in static[2]] == [(layer, ids) for layer, ids, _ in eager[2]]


def test_graph_step_sums_experts_in_expert_id_order(top4_model, monkeypatch, one_thread):
    """The eager paths add a token's experts in expert-id order; the graph must too (top-k order changes bits)."""
    order = []
    real = compiled_step._expert
    monkeypatch.setattr(
        compiled_step, "_expert", lambda s, act, h, hb, st, e: order.append(int(e)) or real(s, act, h, hb, st, e)
    )
    model = top4_model
    model.compiled = CudaGraphDecode(model, capture=False)
    try:
        greedy(model, torch.tensor([[5, 9, 3]]), 3)
    finally:
        model.compiled = None
    k = model.config.num_experts_per_tok
    per_layer = [order[i : i + k] for i in range(0, len(order), k)]
    assert len(per_layer) == 3 * len(model.config.moe_layers)
    assert all(ids == sorted(ids) for ids in per_layer) and any(len(set(ids)) == k for ids in per_layer)


def test_static_buffers_grow_and_the_cache_points_at_them(bundled_model, one_thread):
    model = bundled_model
    step = CudaGraphDecode(model, capture=False)
    model.compiled = step
    try:
        cache = model.new_cache()
        prompt = torch.randint(0, 4000, (1, MIN_CAPACITY - 2), generator=torch.Generator().manual_seed(0))
        eager_cache = model.new_cache()
        tok = torch.tensor([[7]])
        with torch.inference_mode():
            model(prompt, cache, last_only=True)
            model.compiled = None
            model(prompt, eager_cache, last_only=True)
            for i in range(4):  # crosses MIN_CAPACITY: the static buffers are reallocated once
                model.compiled = step
                a = model(tok, cache)
                model.compiled = None
                b = model(tok, eager_cache)
                assert cache.length == eager_cache.length == MIN_CAPACITY - 1 + i
                assert ((a - b).norm() / b.norm()).item() < 1e-5
        assert step.capacity == 2 * MIN_CAPACITY
        assert all(lay.buffers[0] is kv[0] for lay, kv in zip(cache.layers, step.kv))
    finally:
        model.compiled = None


def test_graph_step_is_for_cuda_models(bundled_model):
    assert "CUDA" in unsupported(bundled_model)


@pytest.mark.parametrize("policy", ["lru", "fate-edge"])
def test_layer_graph_step_serves_the_engine(bundled_dir, policy, one_thread):
    """Streamed experts: the scheduler routes, reads and caches between the layer graphs as in eager decode."""
    from fate_edge import GenerateConfig
    from fate_edge.apps.engine_args import resolve_store
    from fate_edge.runtime.engine import Engine
    from fate_edge.runtime.engine_config import EngineConfig

    store = resolve_store(bundled_dir, progress=False)
    cfg = GenerateConfig(max_tokens=16, ignore_eos=True)
    with Engine(EngineConfig(store, "2MB", policy)) as engine:
        want, stats = engine.generate_text("def parse(argv):\n    ", cfg)[0], engine.request_stats
    with Engine(EngineConfig(store, "2MB", policy)) as engine:
        engine.model.compiled = step = LayerGraphDecode(engine.model, capture=False)
        got, got_stats = engine.generate_text("def parse(argv):\n    ", cfg)[0], engine.request_stats
        assert step.failed is None and step.capacity == MIN_CAPACITY
    assert got == want
    if policy == "lru":  # no timing-dependent prefetch: the same hits and reads
        assert (got_stats.hits, got_stats.misses) == (stats.hits, stats.misses)
