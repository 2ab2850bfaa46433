"""gpu_bench's scheduler figures by phase: the prompt's apart from the decode's, per decode token (issue 59: the stall
and re-pack figures covered the whole request, the prompt's many reads included)."""

import pytest
from _scripts import load_script

from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge.runtime.generate import GenerateConfig


@pytest.mark.slow
def test_the_phases_split_the_request_into_prompt_and_decode(bundled_dir):
    gpu_bench = load_script("scripts/gpu_bench.py")
    from fate_edge.format.converted_stores import ensure_store

    store = ensure_store(bundled_dir, progress=False)
    with Engine(EngineConfig(store, "1MB", "lru")) as engine:
        for _ in engine.stream("def add(a, b):", GenerateConfig(max_tokens=9, ignore_eos=True)):
            pass
        whole, ph = engine.request_stats, gpu_bench.phases(engine)
    prefill, decode = ph["prefill"], ph["decode"]
    assert decode["tokens"] == 8 and prefill["tokens"] == 1
    # the prompt's in total plus the decode's per token x tokens: the whole request's
    assert prefill["misses"] + decode["misses"] * 8 == pytest.approx(whole.misses)
    assert prefill["stall_ms"] + decode["stall_ms"] * 8 == pytest.approx(whole.stall_s * 1e3)
    assert prefill["consume_ms"] + decode["consume_ms"] * 8 == pytest.approx(whole.consume_s * 1e3)
    assert prefill["misses"] > decode["misses"]  # the prompt's reads were what the request's figures were made of
    rows = {"fate-edge preset 1GB": {"decode_tps": 1.0, "prefill_tps": 1.0, "phases": ph}}
    result = {"gpu": "GPU", "torch": "t", "cuda": "c", "prompt_tokens": 5, "decode_tokens": 9, "rows": rows}
    line = next(
        x for x in gpu_bench.table(result).splitlines() if x.startswith("| fate-edge preset 1GB | ") and "/" in x
    )
    assert f"{decode['stall_ms']:.2f} / {decode['consume_ms']:.2f}" in line
