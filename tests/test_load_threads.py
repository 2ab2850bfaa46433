"""A batched engine loads on one torch thread (``runtime.load_threads``): its batcher thread must hold the process's
only OpenMP team, or libgomp throttles every team's spin-waiting and the bundled model decodes ~4x slower."""

import pytest
import torch

import fate_edge.runtime.engine as engine_module
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.load_threads import one_torch_thread


@pytest.fixture(scope="module")
def bundled_store(tmp_path_factory, bundled_dir):
    out = tmp_path_factory.mktemp("load-threads") / "tiny-int4"
    convert(bundled_dir, out, ConvertOptions(bits=4), progress=False)
    return out


def test_one_torch_thread_holds_one_thread_for_the_block_and_restores_the_setting():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with one_torch_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with one_torch_thread(active=False):
            assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), one_torch_thread():
            raise RuntimeError("a failed load")
        assert torch.get_num_threads() == 2  # restored on the way out of a failure too
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("max_batch, threads_at_load", [(4, 1), (0, 1), (1, 2)])
def test_a_batched_engine_loads_on_one_thread_and_computes_on_all(
    bundled_store, monkeypatch, max_batch, threads_at_load
):
    """max_batch > 1 (or 0, the machine's default of 8): loaded on one thread; alone (1): the caller's thread
    computes, so it loads with the threads it has. Either way the process keeps its setting afterwards."""
    seen = []
    real = engine_module.load_model

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "load_model", recording)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with Engine(bundled_store, memory_budget="2MB", max_batch=max_batch) as eng:
            assert seen == [threads_at_load]
            assert torch.get_num_threads() == 2
            assert (eng.batcher is not None) == (max_batch != 1)
    finally:
        torch.set_num_threads(before)
