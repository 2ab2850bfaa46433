"""The planner's batch-size roofline (planning/batch_size.py): the union of a batch's experts, the step it predicts,
and the batch it chooses under a latency cap."""

import pytest

from fate_edge_lab.bench.batch_size import StepCosts, choose_batch, predict, union_size


def _costs(**kw) -> StepCosts:
    base = dict(
        step_s=0.010,
        expert_s=0.0005,
        read_s=0.0002,
        reads_per_step=4.0,
        experts_per_layer=[[2 / 16] * 16 for _ in range(8)],
        cached=[list(range(5)) for _ in range(8)],
        expert_flops=2 * 3 * 192 * 128,
        rest_flops=2e6,
        peak_flops=2e10,
    )
    return StepCosts(**(base | kw))


def test_union_of_uniform_routing():
    p = [2 / 16] * 16
    assert union_size(p, 1) == pytest.approx(2.0)
    assert union_size(p, 8) == pytest.approx(16 * (1 - (14 / 16) ** 8))  # ~10.5 of 16
    assert union_size([1.0, 0.0], 5) == pytest.approx(1.0)  # one expert everyone routes to


def test_prediction_at_one_reproduces_the_measured_step():
    c = _costs()
    one = predict(c, 1)
    assert one.step_s == pytest.approx(c.step_s)  # calibrated on it
    assert one.union == pytest.approx(16) and one.reads == pytest.approx(4.0)
    eight = predict(c, 8)
    assert eight.union > 5 * one.union and eight.step_s > one.step_s and eight.tokens_per_s > one.tokens_per_s
    with pytest.raises(ValueError):
        predict(c, 0)


def test_choice_maximises_throughput_within_the_latency_cap():
    c = _costs(expert_s=0.002)  # experts dominate: the step grows with the union
    free, preds = choose_batch(c, 8, latency_cap=100.0)
    capped, _ = choose_batch(c, 8, latency_cap=2.0)
    assert free == max(preds, key=lambda p: p.tokens_per_s).batch
    assert preds[capped - 1].step_s <= 2.0 * preds[0].step_s and capped <= free
    skewed = _costs(experts_per_layer=[[1.0, 1.0] + [0.0] * 14 for _ in range(8)])  # every token: experts 0 and 1
    assert predict(skewed, 8).union == pytest.approx(16) and choose_batch(skewed, 8)[0] == 8


def test_read_cost_is_the_slope_of_token_times_over_reads():
    from fate_edge.runtime.scheduler import SchedulerStats
    from fate_edge_lab.bench.batch_size import read_cost

    reads = [0, 1, 3, 2, 0, 4, 1, 2]
    stats = [SchedulerStats(misses=r - r // 2, prefetch_hits=r // 2) for r in reads]
    times = [0.003 + 0.00025 * r + (0.00001 if i % 2 else -0.00001) for i, r in enumerate(reads)]  # 250 us a read
    assert read_cost(times, stats) == pytest.approx(0.00025, rel=0.05)
    assert read_cost(times[:2], stats[:2]) is None  # too few tokens
    assert read_cost([0.003] * 4, [SchedulerStats(misses=2)] * 4) is None  # the counts do not vary
    assert read_cost([0.004, 0.003, 0.002], [SchedulerStats(misses=m) for m in (0, 1, 2)]) is None  # not positive


def test_head_rate_times_the_models_own_output_layer(monkeypatch):
    from types import SimpleNamespace

    import torch

    import fate_edge_lab.bench.batch_size as batch_size

    now = [0.0]
    took = [0.050, 0.012, 0.010]  # a slow first call, then the timed ones: the best of them counts
    seen = []

    def head_call(x, head):  # advances a fake clock: no timing of this machine enters the test
        seen.append((tuple(x.shape), x.dtype, head))
        now[0] += took.pop(0)
        return x.new_zeros(x.shape[0], 1000)

    monkeypatch.setattr("fate_edge.model.layer.apply_linear", head_call)
    monkeypatch.setattr(batch_size, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    model = SimpleNamespace(head="the head", config=SimpleNamespace(hidden_size=64), dtype=torch.bfloat16, device="cpu")
    rate = batch_size.measure_head_rate(model, rows=8, repeats=2)
    assert rate == pytest.approx(2 * 8 * 1000 * 64 / 0.010)  # the head's FLOPs over its best call
    assert seen == [((8, 64), torch.bfloat16, "the head")] * 3  # a warm-up call, then the timed ones


def test_pair_probe_adds_the_batched_paths_own_cost_from_two_sequences_on():
    from fate_edge_lab.bench.batch_size import with_pair_probe

    c = _costs()
    two = predict(c, 2).step_s
    probed = with_pair_probe(c, two + 0.003)  # a step of two measured 3 ms over the model of single steps
    assert probed.batch_path_s == pytest.approx(0.003)
    assert predict(probed, 1).step_s == pytest.approx(predict(c, 1).step_s)  # one sequence: the fused step
    for b in (2, 4, 8):
        assert predict(probed, b).step_s == pytest.approx(predict(c, b).step_s + 0.003)
        assert predict(probed, b).terms["batch path"] == pytest.approx(0.003)
    assert with_pair_probe(c, two - 0.001).batch_path_s == 0.0  # faster than predicted: nothing added
    assert with_pair_probe(probed, two + 0.001).batch_path_s == pytest.approx(0.001)  # re-probed from the base model
