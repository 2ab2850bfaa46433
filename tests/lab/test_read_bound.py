"""The fewest-reads bound (planning.read_bound): Belady-MIN's expert reads on recorded layer calls, and the recorder
that records them from a batched step."""

import argparse
import random

import pytest
import torch
from _scripts import load_script

from fate_edge.model.batch_step import Segment, forward_segments
from fate_edge.runtime.cache import AccessInfo
from fate_edge.runtime.cache.expert_cache import ExpertCache
from fate_edge.runtime.cache.factory import make_eviction
from fate_edge_lab.bounds.read_bound import CallRecorder, fewest_reads, fewest_reads_warm

F = frozenset


def reads_with(policy_name: str, calls, capacity: int) -> int:
    """Reads of a real eviction policy on the same calls and room, every miss admitted."""
    policy = make_eviction(policy_name, capacity)
    cache = ExpertCache({0: capacity}, lambda part, cap: policy, 1, partition_of=lambda key: 0)
    reads = 0
    for layer, ids in calls:
        for e in sorted(ids):
            hit = (layer, e) in cache
            cache.access((layer, e), hit, AccessInfo(layer_now=layer, num_layers=4))
            if not hit:
                reads += 1
                cache.insert((layer, e), None, 1, 4)
    return reads


@pytest.mark.parametrize(
    ("calls", "capacity", "reads"),
    [
        ([(0, F({1})), (0, F({2})), (0, F({1}))], 1, 2),  # 2 is not kept: 1 comes back first
        ([(0, F({1, 2})), (0, F({3})), (0, F({1, 2}))], 2, 3),
        ([(0, F({1, 2, 3})), (0, F({1, 2, 3}))], 2, 4),  # a call wider than the room: one re-read at least
        ([(0, F({1})), (1, F({1})), (0, F({1}))], 1, 2),  # (1, 1) is never used again: bypassed
        ([(0, F({1, 2})), (1, F({5})), (0, F({2, 1}))], 0, 5),  # no room: every use a read
    ],
)
def test_fewest_reads_on_hand_made_calls(calls, capacity, reads):
    assert fewest_reads(calls, capacity, num_layers=2) == reads


def test_fewest_reads_is_below_every_policy_and_falls_with_room():
    rng = random.Random(7)
    calls = []
    for _ in range(300):  # 4 layers of 16 experts, calls of 1-8 distinct experts with a popular few
        layer = len(calls) % 4
        calls.append((layer, F(min(15, int(rng.expovariate(0.25))) for _ in range(rng.randint(1, 8)))))
    distinct = len({(layer, e) for layer, ids in calls for e in ids})
    previous = None
    for capacity in (4, 12, 24, 40):
        bound = fewest_reads(calls, capacity, num_layers=4)
        others = {name: reads_with(name, calls, capacity) for name in ("lru", "lfu", "arc")}
        assert distinct <= bound <= min(others.values()), (capacity, bound, others)
        assert bound < max(others.values())  # it does better than some policy, not merely as well
        assert previous is None or bound <= previous
        previous = bound
    assert fewest_reads(calls, distinct, num_layers=4) == distinct  # room for all: each read once


def test_a_warm_cache_saves_at_most_its_room():
    calls = [(0, F({1, 2})), (0, F({3})), (0, F({1, 2})), (0, F({3, 4}))]
    assert fewest_reads(calls, 2, num_layers=1) == 5  # 1, 2, 3 (bypassed), 3 again, 4
    assert fewest_reads_warm(calls, 2, num_layers=1) == 3  # 1 and 2 held beforehand
    assert fewest_reads_warm(calls, 4, num_layers=1) == 0  # room for every expert: nothing to read
    assert fewest_reads_warm(calls, 0, num_layers=1) == 7  # no room: every use a read


def test_fewest_reads_refuses_negative_room():
    with pytest.raises(ValueError, match="capacity"):
        fewest_reads([(0, F({1}))], -1, num_layers=1)


def test_recorder_records_each_layer_union_of_a_batched_step(bundled_model, bundled_tokenizer):
    ids = [bundled_tokenizer.encode(p) for p in ("def main():", "import os")]
    rec = CallRecorder()
    bundled_model.observers.append(rec)
    try:
        segs = [Segment(i, bundled_model.new_cache()) for i in ids]
        forward_segments(bundled_model, segs)
        prompt_calls = rec.take()
        forward_segments(bundled_model, [Segment([5], s.cache) for s in segs])  # one decode token each, batched
        step_calls = rec.take()
        alone = []  # the same token on each sequence alone (its own prompt, then the one-token step)
        for i in ids:
            cache = bundled_model.new_cache()
            bundled_model(torch.tensor([i]), cache)
            rec.take()
            bundled_model(torch.tensor([[5]]), cache)
            alone.append(rec.take())
    finally:
        bundled_model.observers.remove(rec)
    cfg = bundled_model.config
    layers = list(cfg.moe_layers)
    assert [layer for layer, _ in prompt_calls] == layers and [layer for layer, _ in step_calls] == layers
    rows = sum(len(i) for i in ids)
    for _, experts in prompt_calls:
        assert 2 <= len(experts) <= min(cfg.num_experts, rows * cfg.num_experts_per_tok)
    # each layer's call of the batched step computes the union of what each row computes alone
    for j, (layer, experts) in enumerate(step_calls):
        assert all(len(a[j][1]) == cfg.num_experts_per_tok and a[j][0] == layer for a in alone)
        assert experts == alone[0][j][1] | alone[1][j][1]
    assert rec.take() == []


def test_decode_reads_counts_one_request_decode(bundled_dir):
    from fate_edge.format.converted_stores import ensure_store
    from fate_edge.format.store import ExpertStore
    from fate_edge.runtime.engine import Engine
    from fate_edge.runtime.engine_config import EngineConfig
    from fate_edge.runtime.generate import GenerateConfig
    from fate_edge_lab.bounds.read_bound import decode_reads

    store = ensure_store(bundled_dir, cold_bits=2, progress=False, baselines=True)
    s = ExpertStore(store)
    budget = int(0.35 * s.expert_bytes(4) * len(s.index["moe_layers"]) * s.index["num_experts"])
    with Engine(EngineConfig(store, budget, max_batch=1)) as engine:
        cfg = GenerateConfig(max_tokens=12, ignore_eos=True)
        mine, seen_at_first = CallRecorder(), []  # the calls, recorded beside decode_reads' own recorder

        def marked(stream):
            for i, response in enumerate(stream):
                if i == 0:
                    seen_at_first.append(len(mine.calls))
                yield response

        engine.model.observers.append(mine)
        out, r = decode_reads(engine, marked(engine.stream("def parse(line):", cfg)))
        engine.model.observers.remove(mine)
        assert len(out) == 12 and r["decode_tokens"] == 11
        decode = mine.calls[seen_at_first[0] :]  # the calls after the prompt's: 11 tokens through each MoE layer
        assert len(decode) == 11 * len(s.index["moe_layers"]) and all(len(ids) == 2 for _, ids in decode)
        rooms = r["experts"]
        for room in ("cache_room", "whole_budget"):
            want = fewest_reads_warm(decode, rooms[room], len(s.index["moe_layers"])) / 11
            assert r["fewest_reads_per_token"][room] == pytest.approx(want)
        few = r["fewest_reads_per_token"]
        # the whole budget holds more than the engine's cache and its read buffers: no cache of it reads more
        assert 0 <= few["whole_budget"] <= few["cache_room"]
        assert few["whole_budget"] <= r["engine_reads_per_token"]
        assert r["engine_reads_per_token"] > 0 and r["read_gbps"] > 0  # at 35% the decode reads
        assert r["experts"]["cache_room"] < r["experts"]["whole_budget"] < r["experts"]["all"]
        assert engine.model.observers == [engine.scheduler]  # its recorder is gone
        with pytest.raises(ValueError, match="two tokens"):
            decode_reads(engine, engine.stream("x", GenerateConfig(max_tokens=1, ignore_eos=True)))


def test_gpu_bench_table_puts_the_reads_beside_the_fewest():
    gpu_bench = load_script("scripts/gpu_bench.py")
    reads = {
        "engine_reads_per_token": 1.81,
        "fewest_reads_per_token": {"cache_room": 0.5, "whole_budget": 0.4},
        "read_gbps": 2.0,
        "expert_bytes": 4_000_000,
    }
    rows = {
        "fate-edge preset 1GB": {"decode_tps": 48.6, "prefill_tps": 353.0, "hit_rate": 0.906, "reads": reads},
        "transformers bf16 resident": {"decode_tps": 17.6, "prefill_tps": 184.0},
    }
    result = {"gpu": "GPU", "torch": "t", "cuda": "c", "prompt_tokens": 128, "decode_tokens": 64, "rows": rows}
    text = gpu_bench.table(result)
    # 2 GB/s over 0.5 reads of 4 MB a token: 1000 tok/s
    assert "| fate-edge preset 1GB | 1.81 / 0.50 / 0.40 | 2.00 | 1000 |" in text
    assert text.count("| transformers bf16 resident |") == 1  # in the speed table only
    del rows["fate-edge preset 1GB"]["reads"]
    assert "fewest" not in gpu_bench.table(result)  # no budgeted run measured reads: no second table


def test_request_read_bound_serves_the_gpu_bench_request(bundled_dir, capsys):
    from fate_edge.format.converted_stores import ensure_store

    script = load_script("research/request_read_bound.py")
    store = ensure_store(bundled_dir, cold_bits=2, progress=False, baselines=True)
    args = argparse.Namespace(
        store=str(store),
        policy="fate-edge",
        dtype="float32",
        device="cpu",
        prompt_tokens=24,
        decode_tokens=8,
        read_gbps=1.0,
    )
    row = script.measure(args, "2MB")
    assert row["decode_tokens"] == 7 and row["budget"] == "2MB"
    few = row["fewest_reads_per_token"]["cache_room"]
    assert few > 0  # 2 MB holds ~38% of the bundled model's int4 experts: even Belady reads in decode
    assert row["decode_tok_s_cap"]["fewest"] == pytest.approx(1e9 / row["expert_bytes"] / few)  # at 1 GB/s
    assert row["engine_reads_per_token"] >= row["fewest_reads_per_token"]["whole_budget"]
