"""fate-edge's prefetch gate: prefetch only the prediction ranks whose measured hit rate pays for the
reader CPU a read takes from compute, and stop paying for the predictor when none does."""

import pytest

from fate_edge import GenerateConfig
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.format.store import ExpertStore
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge.runtime.policy import PRESETS


@pytest.fixture(scope="module")
def store(tmp_path_factory, bundled_dir):
    out = tmp_path_factory.mktemp("gate") / "tiny-int4"
    convert(bundled_dir, out, ConvertOptions.full(bits=4, keep_bf16=False), progress=False)
    return out


@pytest.fixture()
def engine(store):
    s = ExpertStore(store)
    budget = int(0.35 * s.expert_bytes(4) * len(s.index["moe_layers"]) * s.index["num_experts"])
    with Engine(EngineConfig(store, budget, "fate-edge")) as e:
        yield e


def _evidence(sched, hit_rates, uncached=1.0, read_cpu=0.5e-3, contention=1.0, predict_cost=0.0):
    sched.gate.checks = 50.0
    sched.gate.seen = [uncached * 50.0 for _ in hit_rates]
    sched.gate.used = [q * uncached * 50.0 for q in hit_rates]
    sched._read_cpu, sched._contention, sched._predict_cost = read_cpu, contention, predict_cost


def test_ranks_that_pay_for_their_reader_cpu_are_prefetched(engine):
    s = engine.scheduler
    _evidence(s, [0.9, 0.4])
    # per read 1 ms hidden; cost 0.5 ms of compute: rank 0 nets 0.4 ms, rank 1 loses 0.1 ms.
    assert s._gated(2, per_read=1e-3) == 1
    _evidence(s, [0.9, 0.4], contention=0.0)  # readers have idle cores: every rank that is ever right pays
    assert s._gated(2, per_read=1e-3) == 2
    _evidence(s, [0.9, 0.9], read_cpu=2e-3)  # reads cost more compute than they hide
    assert s._gated(2, per_read=1e-3) == 0


def test_gate_shuts_when_the_gain_does_not_cover_the_predictor(engine):
    s = engine.scheduler
    # Rank 0 pays 0.4 ms per read but is rarely uncached (5% of layers): 0.02 ms per layer < 0.1 ms predictor.
    _evidence(s, [0.9, 0.4], uncached=0.05, predict_cost=0.1e-3)
    assert s._gated(2, per_read=1e-3) == 0
    _evidence(s, [0.9, 0.4], uncached=1.0, predict_cost=0.1e-3)
    assert s._gated(2, per_read=1e-3) == 1


def test_no_prefetch_before_evidence(engine):
    s = engine.scheduler
    s.gate.checks, s._read_cpu = 3.0, 1e-4
    assert s._gated(2, per_read=1e-3) == 0
    assert s._should_predict(False, 0)  # ... but predictions run, to gather it


def test_shut_gate_runs_the_predictor_on_one_layer_call_in_eight(engine, monkeypatch):
    s = engine.scheduler
    calls = {"n": 0}
    original = s.predictor.predict

    def counting(layer, h):
        calls["n"] += 1
        return original(layer, h)

    monkeypatch.setattr(s.predictor, "predict", counting)
    monkeypatch.setattr(s, "_gated", lambda width, per_read: 0)  # the gate stays shut
    s.gate.checks = 100.0  # past the evidence phase
    monkeypatch.setattr(type(s), "new_sequence", lambda self: self.abort())  # keep the evidence across requests
    engine.complete("def f(x):", GenerateConfig(max_tokens=17, ignore_eos=True))
    decode_calls = 16 * len(engine.model.config.moe_layers)
    prefill_calls = len(engine.model.config.moe_layers)
    assert calls["n"] - prefill_calls == pytest.approx(decode_calls / 8, abs=2)
    assert sum(t.prefetch_bytes + t.wasted_bytes for t in engine.token_stats[1:]) == 0  # nothing read ahead


def test_ungated_policy_predicts_every_layer(store):
    s = ExpertStore(store)
    budget = int(0.35 * s.expert_bytes(4) * len(s.index["moe_layers"]) * s.index["num_experts"])
    with Engine(EngineConfig(store, budget, PRESETS["fate-edge"].with_(prefetch_gate=False))) as e:
        assert all(e.scheduler._should_predict(False, 0) for _ in range(20))  # even with width 0


def test_the_gates_ranks_are_read_up_to_fates_width_in_reads():
    """Fate's width rule caps the reads, not the ranks: every rank that pays is a candidate (a cached one takes no
    read), at most ``reads`` of them read; no read fits in a layer (0): nothing."""
    from fate_edge.runtime.prefetch_gate import PrefetchGate, gated

    gate = PrefetchGate(4)
    gate.checks, gate.seen, gate.used = 50.0, [5.0, 20.0, 20.0, 20.0], [5.0, 10.0, 8.0, 8.0]
    assert gated(gate, 1, per_read=1e-3, cost=0.0, predict_cost=1e-5) == (4, 1)
    assert gated(gate, 2, per_read=1e-3, cost=0.0, predict_cost=1e-5) == (4, 2)
    assert gated(gate, 0, per_read=1e-3, cost=0.0, predict_cost=1e-5) == (0, 0)
    assert gated(gate, 1, per_read=1e-3, cost=0.45e-3, predict_cost=1e-5) == (2, 1)  # rank 2 nets -0.05 ms
