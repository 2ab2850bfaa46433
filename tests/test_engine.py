"""The engine under a memory budget: same answers as the resident run, budget respected, clear errors."""

import subprocess
import sys
import textwrap
import threading

import pytest

from fate_edge import GenerateConfig, load_model
from fate_edge.errors import BudgetError
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.format.store import ExpertStore
from fate_edge.runtime.budget import parse_bytes
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge.runtime.generate import generate_from_model
from fate_edge.runtime.policy import PRESETS

PROMPT = "def parse_args(argv):\n    "
CFG = GenerateConfig(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def store(tmp_path_factory, bundled_dir):
    out = tmp_path_factory.mktemp("engine") / "tiny-int4"
    convert(bundled_dir, out, ConvertOptions.full(bits=4, cold_bits=2), progress=False)
    return out


@pytest.fixture(scope="module")
def budget_35(store):
    s = ExpertStore(store)
    return int(0.35 * s.expert_bytes(4) * len(s.index["moe_layers"]) * s.index["num_experts"])


@pytest.fixture(scope="module")
def resident_int4_text(store):
    model = load_model(store, bits=4)  # every expert read at int4, no cache: the reference at this precision
    from fate_edge import Tokenizer

    return generate_from_model(model, Tokenizer(store), PROMPT, CFG)[0]


@pytest.mark.parametrize("name", [n for n in PRESETS if n != "load-on-demand"])
def test_every_policy_gives_the_resident_answer(store, budget_35, resident_int4_text, name):
    # Same precision as the reference: precision mixing (Fate's int2 prefill tail) is a separate switch.
    policy = PRESETS[name].with_(cold_bits=None)
    trace = None
    if policy.predictor == "oracle":
        with Engine(EngineConfig(store, budget_35, "lru")) as rec:
            trace = rec.record_trace(PROMPT, CFG)
    with Engine(EngineConfig(store, budget_35, policy, trace=trace)) as engine:
        text, last = engine.generate_text(PROMPT, CFG)
        assert text == resident_int4_text
        s = engine.stats
        assert s.uses > 0 and s.hits + s.prefetch_hits + s.misses == s.uses
        if engine.cache is not None:
            assert engine.cache.used_bytes <= engine.plan.cache_bytes
            assert engine.cache.used_bytes + engine.plan.pool_bytes + engine.plan.working_bytes <= budget_35
        assert len(engine.token_stats) == CFG.max_tokens - 1  # per decode step after the first token
        if policy.predictor is not None:
            assert s.prefetch_hits + s.wasted_bytes > 0  # it did prefetch


def test_bf16_load_on_demand_matches_resident_bf16(store, bundled_model, bundled_tokenizer):
    ref = generate_from_model(bundled_model, bundled_tokenizer, PROMPT, CFG)[0]
    with Engine(EngineConfig(store, "4MB", "load-on-demand")) as engine:
        assert engine.generate_text(PROMPT, CFG)[0] == ref
        assert engine.stats.hits == 0 and engine.stats.misses == engine.stats.uses


def test_oracle_bounds_the_hit_rate(store, budget_35):
    with Engine(EngineConfig(store, budget_35, "lru")) as rec:
        trace = rec.record_trace(PROMPT, CFG)
        lru_hit = rec.stats.hit_rate
    with Engine(EngineConfig(store, budget_35, "oracle", trace=trace)) as oracle:
        oracle.generate_text(PROMPT, CFG)
        assert oracle.stats.hit_rate >= lru_hit
        assert oracle.stats.exact_match == 1.0  # clairvoyant predictions are the true experts


def test_fate_prefill_tail_uses_int2(store, budget_35):
    with Engine(EngineConfig(store, budget_35, "fate")) as engine:
        engine.generate_text("import os\nimport sys\nfrom pathlib import Path\n\n\ndef main(argv):\n", CFG)
        assert engine.prefill_stats.low_precision > 0
        assert sum(t.low_precision for t in engine.token_stats) == 0  # decode stays int4


def test_budget_below_minimum_is_refused_with_the_minimum(store):
    with pytest.raises(BudgetError, match=r"below the minimum .* raise --memory-budget to at least"):
        Engine(EngineConfig(store, "10KB", "fate"))


def test_parse_bytes():
    assert parse_bytes("2GB") == 2_000_000_000 and parse_bytes("1.5MiB") == 1_572_864 and parse_bytes(512) == 512
    with pytest.raises(ValueError, match="512MB"):
        parse_bytes("lots")


@pytest.mark.slow
def test_peak_rss_within_resident_plus_budget(store, budget_35):
    """A fresh process generates 256 tokens; its RSS growth stays within resident weights + budget + 64 MB."""
    code = textwrap.dedent(f"""
        import torch
        torch.set_num_threads(1)
        from fate_edge import GenerateConfig
        from fate_edge.runtime.engine import Engine
        from fate_edge.runtime.engine_config import EngineConfig
        from fate_edge.runtime.generate import peak_rss_bytes
        import psutil
        base = psutil.Process().memory_info().rss  # interpreter + torch, before any model byte
        with Engine(EngineConfig({str(store)!r}, {budget_35}, "fate-edge")) as e:
            resident = sum(t.numel() * t.element_size() for t in e.model.w.values())
            e.generate_text("def main():", GenerateConfig(max_tokens=256, ignore_eos=True))
            peak = peak_rss_bytes()
            print(peak - base, resident)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    growth, resident = map(int, out.stdout.split())
    assert growth <= resident + budget_35 + 64 * 2**20, (growth, resident, budget_35)


def test_failed_read_fails_one_request_and_leaves_the_engine_clean(store, budget_35):
    from fate_edge.fetch.fetch_engine import FetchError

    with Engine(EngineConfig(store, budget_35, "fate-edge")) as engine:
        calls = {"n": 0}

        def fail_once(ref):
            calls["n"] += 1
            if calls["n"] == 30:
                raise OSError(5, "Input/output error (injected)")

        engine.fetch.fault_injector = fail_once
        with pytest.raises(FetchError, match="read failed"):
            engine.generate_text(PROMPT, CFG)
        assert engine.fetch.pool.available == engine.fetch.pool.count  # every buffer came back
        assert not engine.scheduler.demands and not engine.scheduler.prefetches
        if engine.cache is not None:
            assert all(e.pins == 0 for e in engine.cache.entries.values())
        engine.fetch.fault_injector = None
        text, last = engine.generate_text(PROMPT, CFG)  # the next request is served normally
        assert last.generation_tokens == CFG.max_tokens


def test_memory_shortfall_counts_one_pool_on_unified_memory_and_two_on_a_discrete_gpu():
    from fate_edge.runtime.budget import memory_shortfall

    mb = 10**6
    # Jetson: cache (600) + staging (100) compete for the one DRAM with 650 available.
    assert "share" in memory_shortfall(100 * mb, 600 * mb, 650 * mb, device_free=600 * mb, unified=True)
    assert memory_shortfall(100 * mb, 500 * mb, 650 * mb, device_free=600 * mb, unified=True) is None
    # Discrete GPU: the same split fits (cache on the GPU, staging on the host) ...
    assert memory_shortfall(100 * mb, 600 * mb, 650 * mb, device_free=600 * mb, unified=False) is None
    # ... unless the GPU lacks room for the cache, or the host for the pinned buffers.
    assert "GPU memory" in memory_shortfall(100 * mb, 700 * mb, 650 * mb, device_free=600 * mb, unified=False)
    assert "pinned" in memory_shortfall(700 * mb, 100 * mb, 650 * mb, device_free=600 * mb, unified=False)
    assert "lower --memory-budget" in memory_shortfall(10 * mb, 990 * mb, 500 * mb, device_free=None, unified=False)


def test_a_budget_the_machine_cannot_hold_is_refused(store, monkeypatch):
    import psutil

    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=3 * 10**6))
    # refused before loading, with the memory account (memory_account.shortfall)
    with pytest.raises(BudgetError, match=r"only 3 MB is free; loading the resident weights alone takes more"):
        Engine(EngineConfig(store, "64MB", "lru"))


def test_close_frees_the_cached_experts_at_once(store, budget_35):
    engine = Engine(EngineConfig(store, budget_35, "lru"))
    engine.complete(PROMPT, CFG)
    assert engine.cache.used_bytes > 0
    engine.close()
    assert engine.cache.used_bytes == 0 and not engine.cache.entries


def test_an_abandoned_open_stream_does_not_block_the_next_request(store, budget_35, resident_int4_text):
    from fate_edge.errors import StreamSupersededError

    with Engine(EngineConfig(store, budget_35, "fate-edge")) as engine:
        engine.stream_idle_timeout = 0.5  # a server would keep the default; the test need not wait that long
        abandoned = engine.stream(PROMPT, CFG)
        next(abandoned)  # open, kept alive, never read again nor closed
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("text", engine.generate_text(PROMPT, CFG)[0]), daemon=True)
        t.start()
        t.join(120)
        assert out.get("text") == resident_int4_text  # served in full, with the right answer
        with pytest.raises(StreamSupersededError, match="close"):
            next(abandoned)
        # A stream that keeps being read is never superseded: two generators, the second waits for the first.
        first, second = engine.stream(PROMPT, CFG), engine.stream(PROMPT, CFG)
        text = next(first).text
        nxt = threading.Thread(target=lambda: out.setdefault("second", "".join(s.text for s in second)), daemon=True)
        nxt.start()
        text += "".join(s.text for s in first)
        nxt.join(120)
        assert text == out["second"] == resident_int4_text


def test_close_waits_for_the_step_in_progress(store, budget_35):
    from fate_edge.errors import EngineClosedError

    engine = Engine(
        EngineConfig(store, budget_35, "load-on-demand-int4")
    )  # every expert is a read: a closed fetch would show
    entered, release = threading.Event(), threading.Event()
    second_layer = engine.model.config.moe_layers[1]

    def hold(layer, h, idx, weights):  # pause the first decode step part way, before its reads
        if h.shape[0] == 1 and layer == second_layer and not entered.is_set():
            entered.set()
            release.wait()

    engine.model.observers.insert(0, hold)
    got = {"steps": []}

    def consume():
        try:
            for step in engine.stream(PROMPT, CFG):
                got["steps"].append(step)
        except Exception as exc:
            got["error"] = exc

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    assert entered.wait(60)
    closer = threading.Thread(target=engine.close, daemon=True)
    closer.start()
    closer.join(0.5)
    assert closer.is_alive()  # close() waits for the step that is running
    release.set()
    reader.join(60)
    closer.join(60)
    assert len(got["steps"]) == 2  # the running step finished normally ...
    assert isinstance(got.get("error"), EngineClosedError)  # ... and the next one was refused
    assert engine.fetch.pool.available == engine.fetch.pool.count  # every read buffer came back
