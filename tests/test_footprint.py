"""What a store needs in memory (footprint.memory_need) against what an Engine really holds."""

import pytest
import torch

from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge.runtime.footprint import RUNTIME_BASELINE_BYTES, kv_cache_bytes, memory_need


@pytest.fixture(scope="module")
def store(tmp_path_factory, bundled_dir):
    return convert(
        bundled_dir, tmp_path_factory.mktemp("fp") / "s", ConvertOptions.full(bits=4, keep_bf16=False), progress=False
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_resident_bytes_are_what_the_engine_loads(dtype, store, one_thread):
    need = memory_need(store, 3_000_000, dtype, context_tokens=100)
    with Engine(EngineConfig(store, 3_000_000, "lru", dtype=dtype)) as engine:
        loaded = sum(t.numel() * t.element_size() for t in engine.model.w.values())
        cache = engine.model.new_cache()
        with torch.no_grad():
            engine.model.forward(torch.arange(100).unsqueeze(0), cache, last_only=True)
    assert need.resident_bytes == loaded
    assert 0 < cache.nbytes <= kv_cache_bytes(store, 100)  # the KV cache of 100 tokens fits the bound
    assert need.baseline_bytes == RUNTIME_BASELINE_BYTES + kv_cache_bytes(store, 100)
    assert need.total == need.resident_bytes + 3_000_000 + need.baseline_bytes


@pytest.mark.parametrize("bits", [8, 4])
def test_resident_bytes_count_quantized_resident_weights(bits, store, one_thread):
    need = memory_need(store, 3_000_000, "bfloat16", context_tokens=100, resident_bits=bits)
    with Engine(EngineConfig(store, 3_000_000, "lru", dtype="bfloat16", resident_bits=bits)) as engine:
        loaded = sum(t.numel() * t.element_size() for t in engine.model.w.values())
    assert need.resident_bytes == loaded
    assert need.resident_bytes < 0.7 * memory_need(store, 3_000_000, "bfloat16").resident_bytes
