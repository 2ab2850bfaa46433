"""The device running out of memory mid-request: a one-line error, nothing left in flight, the engine still serves.

Simulated on the CPU: the model's forward raises torch.OutOfMemoryError (what CUDA raises) on its Nth call."""

import pytest
import torch

from fate_edge import GenerateConfig
from fate_edge.apps.engine_args import resolve_store
from fate_edge.apps.server.errors import error_from_exception
from fate_edge.errors import DeviceMemoryError
from fate_edge.model.transformer import MoETransformer
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge.runtime.generate import generate_from_model

PROMPT = "def parse(argv):\n    "


def fail_on_call(monkeypatch, n: int) -> None:
    real = MoETransformer.__call__
    calls = [0]

    def call(self, *a, **kw):
        calls[0] += 1
        if calls[0] == n:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (simulated)")
        return real(self, *a, **kw)

    monkeypatch.setattr(MoETransformer, "__call__", call)


def test_resident_generation_reports_running_out_of_device_memory(bundled_model, bundled_tokenizer, monkeypatch):
    cfg = GenerateConfig(max_tokens=8, ignore_eos=True)
    want = generate_from_model(bundled_model, bundled_tokenizer, PROMPT, cfg)[0]
    fail_on_call(monkeypatch, 4)  # the prompt, then the third decode step
    with pytest.raises(DeviceMemoryError) as err:
        generate_from_model(bundled_model, bundled_tokenizer, PROMPT, cfg)
    msg = str(err.value)
    assert "\n" not in msg and "ran out of memory during the decode" in msg and "--memory-budget" in msg
    assert bundled_model.active_cache is None  # the failed request's KV cache is not held through the model
    monkeypatch.undo()
    assert generate_from_model(bundled_model, bundled_tokenizer, PROMPT, cfg)[0] == want


def test_engine_survives_running_out_of_device_memory(bundled_dir, monkeypatch):
    store = resolve_store(bundled_dir, progress=False)
    cfg = GenerateConfig(max_tokens=12, ignore_eos=True)
    with Engine(EngineConfig(store, "2MB", "lru")) as engine:
        want = engine.generate_text(PROMPT, cfg)[0]
        fail_on_call(monkeypatch, 2)  # during the prompt's first decode step
        with pytest.raises(DeviceMemoryError, match="during the decode"):
            engine.generate_text(PROMPT, cfg)
        monkeypatch.undo()
        pool = engine.fetch.pool
        assert pool.available == pool.count and not engine.scheduler.prefetches and not engine.scheduler.in_use
        assert engine.generate_text(PROMPT, cfg)[0] == want


def test_daemon_answers_503_for_device_memory():
    err = error_from_exception(DeviceMemoryError("cuda ran out of memory during the decode"))
    assert err.status == 503 and err.body()["error"]["code"] == "device_out_of_memory"
