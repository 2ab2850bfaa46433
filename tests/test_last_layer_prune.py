"""A prompt asked for its last logits only runs the last layer's MoE on its last token (model.transformer.forward);
the engine's scheduler still serves that call as part of the prompt, and the answer is the unpruned one."""

import pytest
from _replay import PROMPT

from fate_edge import GenerateConfig
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig

DECODE = GenerateConfig(max_tokens=8, ignore_eos=True)


class _Seen:
    needs_every_token = False

    def __init__(self, engine: Engine):
        self.engine, self.calls = engine, []

    def __call__(self, layer, h, idx, w):  # runs after the scheduler's own observer
        self.calls.append((layer, idx.shape[0], self.engine.scheduler._prefill))


@pytest.fixture(scope="module")
def store(tmp_path_factory, bundled_dir):
    return convert(bundled_dir, tmp_path_factory.mktemp("prune") / "store", ConvertOptions.full(bits=4), progress=False)


def test_the_pruned_last_layer_is_served_as_the_prompt_and_answers_the_same(store, one_thread):
    with Engine(EngineConfig(store, "64MB", "fate-edge")) as engine:
        seen = _Seen(engine)
        engine.model.observers.append(seen)
        text, _ = engine.generate_text(PROMPT, DECODE)
        moe = engine.model.config.moe_layers
        prompt = seen.calls[: len(moe)]
        assert [layer for layer, _, _ in prompt] == moe
        assert prompt[-1][1] == 1 and all(rows > 1 for _, rows, _ in prompt[:-1])  # only the last layer pruned
        assert all(as_prompt for _, _, as_prompt in prompt)  # ... and still served as the prompt
        assert not any(as_prompt for _, _, as_prompt in seen.calls[len(moe) :])  # decode steps are not
        pruned_prompt_uses = engine.prefill_stats.uses
    with Engine(EngineConfig(store, "64MB", "fate-edge")) as full:
        full.model.observers.append(lambda *a: None)  # an observer that may need every token: nothing pruned
        assert full.generate_text(PROMPT, DECODE)[0] == text
        assert full.prefill_stats.uses > pruned_prompt_uses  # the last layer routed every prompt token there
