"""The ExpertProvider contract: every provider implements get/stream/end_layer, and the model relies on nothing else."""

import torch

from fate_edge import load_model
from fate_edge.fetch.store_provider import StoreExpertProvider
from fate_edge.format.checkpoint_experts import CheckpointExpertProvider
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.model.experts import ExpertProvider, InMemoryExpertProvider
from fate_edge.runtime.engine import Engine, _NoExperts
from fate_edge.runtime.engine_config import EngineConfig


class OnlyGet(ExpertProvider):
    """A provider that implements the one required method and counts the hooks the model calls."""

    def __init__(self, inner: InMemoryExpertProvider):
        self.inner = inner
        self.ended: list[int] = []

    def get(self, layer, expert):
        return self.inner.get(layer, expert)

    def end_layer(self, layer):
        self.ended.append(layer)


def test_every_provider_implements_the_contract(bundled_dir, tmp_path):
    memory = load_model(bundled_dir, experts="memory")
    lazy = load_model(bundled_dir, experts="lazy")
    store = convert(bundled_dir, tmp_path / "s", ConvertOptions.full(bits=4, keep_bf16=False), progress=False)
    streamed = load_model(store)
    with Engine(EngineConfig(store, "4MB", "lru")) as engine:  # not the whole model (read at load): get() reads
        providers = [memory.experts, lazy.experts, streamed.experts, engine.scheduler, _NoExperts()]
        assert [type(p) for p in providers[:3]] == [
            InMemoryExpertProvider,
            CheckpointExpertProvider,
            StoreExpertProvider,
        ]
        for p in providers:
            assert isinstance(p, ExpertProvider), type(p)
            assert callable(p.stream) and callable(p.end_layer) and callable(p.get)
        # The scheduler serves get() through its own path: the same weights the store provider decodes.
        layer = engine.model.config.moe_layers[0]
        x = torch.randn(3, engine.model.config.hidden_size)
        assert torch.equal(engine.scheduler.get(layer, 5)(x), streamed.experts.get(layer, 5)(x))
        engine.scheduler.end_layer(layer)
        assert engine.scheduler.stats.misses == 1 and not engine.scheduler.in_use
    streamed.experts.close()


def test_a_provider_with_only_get_runs_the_model(bundled_dir, bundled_model):
    provider = OnlyGet(bundled_model.experts)
    model = load_model(bundled_dir, experts=provider)
    ids = torch.tensor([[5, 17, 42, 7]])
    ref = bundled_model(ids, bundled_model.new_cache())
    assert torch.equal(model(ids, model.new_cache()), ref)
    assert provider.ended == model.config.moe_layers  # end_layer once per MoE layer, in order
    pairs = list(provider.stream(model.config.moe_layers[0], [3, 1]))  # the default stream: get() per expert
    assert [e for e, _ in pairs] == [3, 1] and pairs[0][1] is bundled_model.experts.get(0, 3)
