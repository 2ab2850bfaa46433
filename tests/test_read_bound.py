"""The fewest-reads bound (planning.read_bound): Belady-MIN's expert reads on recorded layer calls, and the recorder
that records them from a batched step."""

import random

import pytest
import torch

from fate_edge.model.batch_step import Segment, forward_segments
from fate_edge.planning.read_bound import CallRecorder, fewest_reads
from fate_edge.runtime.cache import AccessInfo
from fate_edge.runtime.cache.expert_cache import ExpertCache
from fate_edge.runtime.cache.factory import make_eviction

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
