"""Prefetch is not starved at small budgets: every MoE layer that is not wholly cached gets read-ahead experts.

Counters on real runs of the bundled model (int4 experts, the int2 tail Fate uses): per-layer expert uses in
decode, as cached / prefetched / demand-read, at 20% and 35% of the int4 expert bytes.
"""

import pytest
from _replay import PROMPT, all_expert_bytes

from fate_edge import GenerateConfig
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig

DECODE = GenerateConfig(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def store(tmp_path_factory, bundled_dir):
    out = tmp_path_factory.mktemp("room") / "tiny-int4-int2"
    return convert(bundled_dir, out, ConvertOptions.full(bits=4, cold_bits=2, keep_bf16=False), progress=False)


def decode_uses(engine: Engine) -> dict[int, list[int]]:
    """Per MoE layer, [cached, prefetched, demand] expert uses of the decode steps (prefill left out)."""
    steps = engine.stream(PROMPT, DECODE)
    next(steps)  # the prompt's prefill and the first token
    before = {layer: list(v) for layer, v in engine.scheduler.layer_uses.items()}
    for _ in steps:
        pass
    return {
        layer: [a - b for a, b in zip(v, before.get(layer, [0, 0, 0]))]
        for layer, v in engine.scheduler.layer_uses.items()
    }


@pytest.mark.parametrize("share", [0.20, 0.35])
def test_fate_prefetches_reach_every_layer_after_the_first(store, one_thread, share):
    with Engine(EngineConfig(store, int(share * all_expert_bytes(store)), "fate")) as engine:
        uses = decode_uses(engine)
        layers = engine.model.config.moe_layers[1:]
        open_layers = [layer for layer in layers if engine.plan.slots.get(layer, 0) < engine.model.config.num_experts]
    assert len(open_layers) >= len(layers) - 2  # a small budget: most layers cannot hold all their experts
    # Before read-ahead had room of its own, every other layer got none (its predecessor's reads held the room).
    starved = {layer: uses[layer] for layer in open_layers if 4 * uses[layer][1] < uses[layer][1] + uses[layer][2]}
    assert not starved, f"prefetched in under a quarter of the uncached uses (cached/prefetched/demand): {starved}"
