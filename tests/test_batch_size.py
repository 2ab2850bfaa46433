"""The planner's batch-size roofline (planning/batch_size.py): the union of a batch's experts, the step it predicts,
and the batch it chooses under a latency cap."""

import pytest

from fate_edge.planning.batch_size import StepCosts, choose_batch, predict, union_size


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
