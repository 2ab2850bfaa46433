"""Torch's threads under "auto" (runtime.auto_threads): the cores less the fetch workers while experts stream, every
core once a model at least 1024 wide that the budget holds whole is loaded (its workers have nothing left to read);
a number is kept as given."""

from __future__ import annotations

import pytest
import torch
from fate_edge.devices.detect import available_cores, thread_split

from fate_edge.runtime.auto_threads import auto_threads
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.generate import GenerateConfig


def test_every_core_only_for_a_wide_model_nothing_streams_for_on_a_cpu():
    assert auto_threads(8, streams=False, hidden_size=2048, device="cpu") == 8
    assert auto_threads(8, streams=True, hidden_size=2048, device="cpu") == thread_split(8)[0] == 6
    assert auto_threads(2, streams=True, hidden_size=2048, device="cpu") == 1
    assert auto_threads(2, streams=False, hidden_size=256, device="cpu") == 1  # the bundled model: too narrow
    assert auto_threads(2, streams=False, hidden_size=2048, device="cuda") == 1
    assert auto_threads(1, streams=False, hidden_size=2048, device="cpu") == 1


@pytest.fixture(scope="module")
def wide_store(tmp_path_factory):
    from _tiny_moe import build_wide_moe

    from fate_edge.format.convert import convert

    tmp = tmp_path_factory.mktemp("wide")
    return convert(build_wide_moe(tmp / "m", 1024, vocab=1024), tmp / "s", progress=False)


def test_a_wide_model_the_budget_holds_computes_on_every_core_and_a_streamed_one_leaves_the_readers_theirs(wide_store):
    before = torch.get_num_threads()
    try:
        with Engine.load(wide_store, device="cpu") as eng:  # the automatic budget holds it: read whole at load
            assert eng.scheduler.all_at_hand
            assert torch.get_num_threads() == available_cores()
            assert eng.generate_text("def f():", GenerateConfig(max_tokens=3))[1].generation_tokens == 3
        with Engine.load(wide_store, memory_budget="12MB", device="cpu") as eng:  # 2 of its 8 experts at a time
            assert not eng.scheduler.all_at_hand
            assert torch.get_num_threads() == thread_split()[0]
        with Engine.load(wide_store, device="cpu", threads=1):
            assert torch.get_num_threads() == 1  # a number is the user's
    finally:
        torch.set_num_threads(before)
