"""The ``fate`` preset as the authors published it (FFFzy/Fate_open), checked by counts on real models:
the first MoE layer resident in full precision and never predicted, the cache filled at load (reads counted
apart from requests), prefill misses in int4 with only the prefetched tail in int2, the tail share by model
type, and no prediction when the next layer is fully cached."""

import pytest
import torch

from fate_edge import GenerateConfig
from fate_edge.fetch.fetch_engine import Priority
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.format.store import ExpertStore
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge.runtime.policy import PRESETS

PROMPT = "import os\nimport sys\nfrom pathlib import Path\n\n\ndef main(argv):\n    "
CFG = GenerateConfig(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def _one(one_thread):
    yield


@pytest.fixture(scope="module")
def store(tmp_path_factory, bundled_dir):
    out = tmp_path_factory.mktemp("fatepub") / "tiny-int4"
    convert(bundled_dir, out, ConvertOptions.full(bits=4, cold_bits=2), progress=False)
    return out


def budget(store, fraction: float) -> int:
    s = ExpertStore(store)
    return int(fraction * s.expert_bytes(4) * len(s.index["moe_layers"]) * s.index["num_experts"])


def record_reads(engine) -> list[tuple[int, int, int, Priority]]:
    """(layer, expert, bits, priority) of every read the fetch engine is asked for from now on."""
    reads, submit = [], engine.fetch.submit

    def spy(ref, priority, **kw):  # kw: `into`, a host-tier slot
        reads.append((ref.layer, ref.expert, ref.bits, priority))
        return submit(ref, priority, **kw)

    engine.fetch.submit = spy
    return reads


def record_predictions(engine) -> list[tuple[int, tuple[int, ...]]]:
    """(source layer, target layers) of every prediction from now on: a decode row's one-call ranking
    (``top_row``, where it gives one) or ``predict``."""
    calls, predictor = [], engine.scheduler.predictor
    predict, top_row = predictor.predict, predictor.top_row

    def spy(layer, h):
        pred = predict(layer, h)
        calls.append((layer, tuple(pred.layers)))
        return pred

    def spy_row(layer, h, n):
        got = top_row(layer, h, n)
        if got is not None:
            calls.append((layer, (got[0],)))
        return got

    predictor.predict, predictor.top_row = spy, spy_row
    return calls


def held(engine, layer: int) -> dict[int, int]:
    """Expert → bits of what the cache holds for ``layer``."""
    return {k[1]: e.bits for k, e in engine.cache.entries.items() if k[0] == layer}


def within_budget(engine, total: int) -> None:
    assert engine.cache.used_bytes <= engine.plan.cache_bytes
    assert engine.plan.cache_bytes + engine.plan.pool_bytes + engine.plan.working_bytes <= total


def test_first_layer_resident_in_full_precision_never_predicted_nor_read(store):
    total = budget(store, 1.2)  # room for layer 0 in full precision (float32 compute: 2x the bf16 bytes)
    with Engine(EngineConfig(store, total, "fate")) as engine:
        first = engine.model.config.moe_layers[0]
        e = engine.model.config.num_experts
        assert engine.load_report.resident_layer == first and engine.load_report.resident_bits == 16
        assert held(engine, first) == {x: 16 for x in range(e)}
        within_budget(engine, total)
        reads, calls = record_reads(engine), record_predictions(engine)
        engine.generate_text(PROMPT, CFG)
        assert held(engine, first) == {x: 16 for x in range(e)}  # never evicted
        assert not [r for r in reads if r[0] == first]  # never read per token
        assert calls and all(first not in targets for _, targets in calls)  # never predicted
        within_budget(engine, total)


def test_first_layer_falls_back_to_int4_when_the_budget_cannot_hold_bf16(store):
    total = budget(store, 0.35)
    with Engine(EngineConfig(store, total, "fate")) as engine:
        first, e = engine.model.config.moe_layers[0], engine.model.config.num_experts
        r = engine.load_report
        assert r.resident_layer == first and r.resident_bits == 4 and "bf16 would need" in r.note
        assert "resident as int4" in r.describe()
        assert held(engine, first) == {x: 4 for x in range(e)}
        within_budget(engine, total)


@pytest.fixture(scope="module")
def uncalibrated(store, tmp_path_factory):
    """The store without its calibration counts (predictors/popularity.json)."""
    import shutil

    own = tmp_path_factory.mktemp("uncalibrated") / "store"
    shutil.copytree(store, own)
    (own / "predictors" / "popularity.json").unlink()
    return own


def test_cache_filled_at_load_by_index_and_reads_counted_apart(uncalibrated):
    total = budget(uncalibrated, 0.35)
    with Engine(EngineConfig(uncalibrated, total, "fate")) as engine:
        assert engine.popularity is None
        slots, s = engine.plan.slots, engine.store
        assert sum(slots.values()) > engine.model.config.num_experts  # more than the resident layer
        expected = {(layer, x) for layer, n in slots.items() for x in range(n)}  # Fate: lowest ids first
        assert set(engine.cache.entries) == expected
        r = engine.load_report
        assert r.reads == len(expected) == sum(len(v) for v in r.experts.values())
        assert r.bytes_read == sum(
            s.ref(layer, x, engine.cache.entries[(layer, x)].bits).length for layer, x in expected
        )
        assert engine.stats.demand_bytes == engine.stats.prefetch_bytes == engine.stats.uses == 0
        assert engine.scheduler.copier.uploads == 0  # nor in the per-token upload count
        engine.generate_text(PROMPT, CFG)
        per_token = [engine.prefill_stats, *engine.token_stats]
        assert (
            sum(t.demand_bytes + t.prefetch_bytes for t in per_token)
            == engine.stats.demand_bytes + engine.stats.prefetch_bytes
        )  # load reads are in none of them
        assert engine.prefill_stats.hits > 0  # the first token does not start cold


def test_cache_filled_at_load_by_calibrated_popularity(store):
    with Engine(EngineConfig(store, budget(store, 0.35), "fate")) as engine:
        counts, e = engine.popularity, engine.model.config.num_experts
        assert counts  # the bundled model ships its calibration counts
        partial = {layer: n for layer, n in engine.plan.slots.items() if 0 < n < e}
        assert partial
        for layer, n in partial.items():
            top = sorted(range(e), key=lambda x: (-counts[layer][x], x))[:n]
            assert set(held(engine, layer)) == set(top) != set(range(n))


def test_prefill_misses_read_int4_only_the_prefetched_tail_int2(store):
    with Engine(EngineConfig(store, budget(store, 0.35), "fate")) as engine:
        reads = record_reads(engine)
        engine.generate_text(PROMPT, GenerateConfig(max_tokens=1, ignore_eos=True))  # the prefill only
        demand = [r for r in reads if r[3] == Priority.DEMAND]
        cold = [r for r in reads if r[2] == 2]
        assert demand and all(bits == 4 for _, _, bits, _ in demand)
        assert cold and all(p != Priority.DEMAND for *_, p in cold)  # int2 only ever as a prefetch
        assert engine.prefill_stats.low_precision > 0  # and some of that tail was used


def test_no_prediction_when_the_next_layer_is_fully_cached(store):
    with Engine(EngineConfig(store, budget(store, 0.35), "fate")) as engine:
        cfg = engine.model.config
        layers = cfg.moe_layers
        full = [layer for layer in layers if engine.cache.holds_layer(layer, cfg.num_experts)]
        assert full[:2] == layers[:2] and len(full) < len(layers)  # layers 0 and 1 whole, the rest not
        calls = record_predictions(engine)
        engine.generate_text(PROMPT, CFG)
        sources = [src for src, _ in calls]
        skipped_sources = [src for src in layers[:-1] if layers[layers.index(src) + 1] in full]
        assert skipped_sources and not set(sources) & set(skipped_sources)
        steps = 1 + len(engine.token_stats)  # the prefill and each decode step route every layer once
        assert engine.stats.predictions_skipped == steps * len(skipped_sources)
        assert sources.count(layers[len(full) - 1]) == steps  # the last whole layer predicts the partial one


def _deepseek_store(root):
    """A tiny DeepSeek-V2 model (as the parity tests build it: MLA, a dense first layer) with a tokenizer."""
    import transformers
    from _tiny_moe import VOCAB, build_tokenizer

    cfg = transformers.DeepseekV2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        initializer_range=0.1,
        tie_word_embeddings=False,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        num_hidden_layers=3,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        q_lora_rank=None,
        topk_method="greedy",
        routed_scaling_factor=1.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    src = root / "deepseek"
    model.save_pretrained(src)
    build_tokenizer(src)
    out = root / "deepseek-store"
    convert(src, out, ConvertOptions.full(bits=4, cold_bits=2), progress=False)
    return out


def test_tail_share_is_the_model_types(store, tmp_path):
    with Engine(EngineConfig(store, budget(store, 0.35), "fate")) as engine:
        assert engine.model.config.model_type == "qwen2_moe" and engine.policy.cold_tail_mass == 0.3
    ds = _deepseek_store(tmp_path)
    with Engine(EngineConfig(ds, 2_000_000, "fate")) as engine:
        cfg = engine.model.config
        assert cfg.model_type == "deepseek_v2" and engine.policy.cold_tail_mass == 0.5
        assert engine.load_report.resident_layer == cfg.moe_layers[0] != 0  # the first MoE layer, past the dense
        engine.generate_text("def add(a, b):\n    return a + b\n", GenerateConfig(max_tokens=2, ignore_eos=True))
    with Engine(EngineConfig(ds, 2_000_000, PRESETS["fate"].with_(cold_tail_mass=0.2))) as engine:
        assert engine.policy.cold_tail_mass == 0.2  # a value the user set is kept
