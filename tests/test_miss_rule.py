"""The per-miss rule of ``miss_compute="hybrid"`` (runtime.miss_rule), on numbers: a host-held miss runs on the CPU
where computing it (this use and the uses a copy would serve) costs less than copying it up once."""

import pytest

from fate_edge.planning.miss_placement import MissCosts
from fate_edge.runtime.miss_rule import COPY, CPU, MissRule, place

EXPERT, HIDDEN = 1_000_000, 4_096  # bytes: one expert's blob, one row's hidden state


def _rule(**kw) -> MissRule:
    # 1 GB/s: a copy of the expert takes 1 ms (+ 10 us); a row costs the CPU 0.3 ms
    base = dict(cpu_row_s=3e-4, link_s_per_byte=1e-9, link_latency_s=1e-5, top_k=2, num_experts=8, learn=0.0)
    return MissRule(**{**base, **kw})


def test_the_boundary_both_ways():
    assert place(cpu_s=0.99, copy_s=1.0, reuse=0) == CPU
    assert place(cpu_s=1.01, copy_s=1.0, reuse=0) == COPY
    assert place(cpu_s=0.4, copy_s=1.0, reuse=1.4) == CPU  # 0.96 < 1
    assert place(cpu_s=0.4, copy_s=1.0, reuse=1.6) == COPY  # 1.04 > 1


def test_rows_decide_one_row_on_the_cpu_many_rows_copied_up():
    rule = _rule()  # horizon 0: a copy serves no later use
    one = rule.cpu_s(1, HIDDEN)
    assert one == pytest.approx(3e-4 + 2 * (1e-5 + HIDDEN * 1e-9))
    assert rule.copy_s(EXPERT) == pytest.approx(1e-5 + 1e-3)
    assert rule.choose((0, 1), 1, EXPERT, HIDDEN, prompt=False) == CPU
    assert rule.choose((0, 1), 3, EXPERT, HIDDEN, prompt=False) == CPU  # 0.93 ms < 1.01 ms
    assert rule.choose((0, 1), 4, EXPERT, HIDDEN, prompt=False) == COPY  # a batch of 4: 1.23 ms
    assert rule.choose((0, 1), 40, EXPERT, HIDDEN, prompt=True) == COPY  # a prompt's rows


def test_a_popular_expert_is_copied_up_a_cold_one_runs_on_the_cpu():
    rule = _rule(horizon_tokens=4.0)  # a copy stays cached about 4 tokens
    hot, cold = (0, 1), (0, 5)
    for _ in range(20):  # decode tokens: expert 1 used on each, expert 5 never
        rule.observe(0, [1, 2])
    assert rule.reuse(hot) == pytest.approx(4 * (0.9**20 * 0.25 + 1 - 0.9**20)) and rule.reuse(hot) > 3
    assert rule.reuse(cold) == pytest.approx(4 * 0.9**20 * 0.25) and rule.reuse(cold) < 0.5
    rule.observe(0, [5])  # used once, then three tokens without it: each token decays it
    for _ in range(3):
        rule.observe(0, [1, 2])
    assert rule.reuse(cold) == pytest.approx(4 * (0.9 * 0.9**20 * 0.25 + 0.1) * 0.9**3)
    assert rule.reuse((1, 5)) == pytest.approx(1.0)  # another layer's tokens leave it at its prior
    assert rule.choose(hot, 1, EXPERT, HIDDEN, prompt=False) == COPY  # 0.33 ms x (1 + 3.6) > 1.01 ms
    assert rule.choose(cold, 1, EXPERT, HIDDEN, prompt=False) == CPU
    fresh = _rule(horizon_tokens=4.0)  # before any token: top_k / num_experts = 1/4 a token, 1 further use
    assert fresh.reuse(cold) == pytest.approx(1.0)
    assert fresh.choose(cold, 1, EXPERT, HIDDEN, prompt=False) == CPU  # 0.64 ms < 1.01 ms


def test_costs_are_weighted_averages_seeded_by_the_planner():
    rule = MissRule(learn=0.5)
    rule.seed(MissCosts(EXPERT, HIDDEN, link_bytes_per_s=1e9, cpu_expert_s=2e-4, link_latency_s=2e-5))
    assert (rule.cpu_row_s, rule.link_s_per_byte, rule.link_latency_s) == (2e-4, 1e-9, 2e-5)
    rule.cpu_measured(8e-4, rows=2)  # 4e-4 a row
    rule.link_measured(1000, 3e-6)  # 3e-9 a byte
    assert rule.cpu_row_s == pytest.approx(3e-4) and rule.link_s_per_byte == pytest.approx(2e-9)
    rule.decode_measured(1e-4)  # the first measurement of a side nothing seeded is taken as it is
    assert rule.cpu_fixed_s == pytest.approx(1e-4)
    frozen = MissRule(learn=0.0, cpu_row_s=1e-4)
    frozen.cpu_measured(1.0, rows=1)
    assert frozen.cpu_row_s == 1e-4


def test_an_unmeasured_side_is_tried_so_that_it_gets_measured():
    unknown_cpu = MissRule(link_s_per_byte=1e-12)
    assert unknown_cpu.choose((0, 0), 1, EXPERT, HIDDEN, prompt=False) == CPU
    assert unknown_cpu.choose((0, 0), 1, EXPERT, HIDDEN, prompt=True) == COPY
    assert unknown_cpu.choose((0, 0), 2, EXPERT, HIDDEN, prompt=False) == COPY
    unknown_link = MissRule(cpu_row_s=1e-9)
    assert unknown_link.choose((0, 0), 1, EXPERT, HIDDEN, prompt=False) == COPY


def test_the_devices_compute_of_a_copy_is_seeded_into_the_copy_side():
    costs = MissCosts(EXPERT, HIDDEN, link_bytes_per_s=1e9, cpu_expert_s=1.1e-3, device_expert_s=2e-4)
    rule = MissRule()
    rule.seed(costs)
    assert rule.copy_s(EXPERT) == pytest.approx(1e-5 + 1e-3 + 2e-4) == costs.copy_s
    assert rule.choose((0, 0), 1, EXPERT, HIDDEN, prompt=False) == CPU  # 1.13 ms < 1.21 ms: the GPU's time tips it
    unseeded = MissRule(cpu_row_s=1.1e-3, link_s_per_byte=1e-9)  # without it: 1.13 ms > 1.01 ms
    assert unseeded.choose((0, 0), 1, EXPERT, HIDDEN, prompt=False) == COPY
