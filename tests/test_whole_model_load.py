"""An engine whose budget holds every expert reads the whole model at load, where a request's own reads would land,
as llama.cpp and Ollama load a model that fits: its first prompt reads nothing, with the tokens of an engine that
reads each expert at its first use."""

from __future__ import annotations

from fate_edge.format.convert import convert
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge.runtime.generate import GenerateConfig


def _run(engine: Engine) -> list[tuple[int | None, object]]:
    cfg = GenerateConfig(max_tokens=8, ignore_eos=True, logprobs=2)
    return [(r.token, r.logprob) for r in engine.stream([3, 17, 99, 5, 250, 7], cfg)]


def test_a_budget_that_holds_the_model_reads_it_at_load(tmp_path):
    from _tiny_moe import build_wide_moe

    store = convert(build_wide_moe(tmp_path / "m", 128, vocab=1024), tmp_path / "s", progress=False)
    with Engine(EngineConfig(store, "auto", dtype="bfloat16")) as whole:
        cfg = whole.model.config
        every = len(cfg.moe_layers) * cfg.num_experts
        assert whole.cache is not None and len(whole.cache.entries) == every
        assert whole.load_report.reads == every and whole.load_report.bytes_read > 0
        assert sorted(e for es in whole.load_report.experts.values() for e in es) == sorted(
            e for _ in cfg.moe_layers for e in range(cfg.num_experts)
        )
        assert whole.scheduler.stats.misses == 0  # load's reads are the load report's
        tokens = _run(whole)
        assert whole.scheduler.stats.misses == 0 and whole.scheduler.stats.demand_bytes == 0
        assert whole.scheduler.stats.hits > 0
    with Engine(EngineConfig(store, 150_000, dtype="bfloat16")) as partial:  # 3 and 2 of each layer's 4
        assert partial.load_report.reads == 0
        assert _run(partial) == tokens  # tokens and logprobs: the same bits
        assert partial.scheduler.stats.misses > 0
