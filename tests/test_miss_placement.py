"""Misses computed where it is cheaper (planning/miss_placement.py): the copy over the link against the CPU's kernel
with the hidden state sent across, from measured speeds; the planner's ``hybrid`` pick."""

import pytest
from fate_edge.devices.link import LinkSpec
from fate_edge.devices.profile import load_profile

from fate_edge.errors import PolicyError
from fate_edge.planning.miss_placement import MissCosts, miss_compute_for, place_miss
from fate_edge.planning.planner import Plan, with_miss_compute
from fate_edge.planning.simulate import HostCosts
from fate_edge.runtime.miss_rule import MissRule
from fate_edge.runtime.policy import PRESETS, PolicyConfig

EXPERT = 4_612_096  # a Qwen1.5-MoE int4 expert
HIDDEN = 2048 * 4  # its hidden state in float32


def test_the_cheaper_place_follows_the_measured_speeds():
    fast_link = MissCosts(EXPERT, HIDDEN, 25e9, cpu_expert_s=400e-6)
    assert fast_link.copy_s == pytest.approx(10e-6 + EXPERT / 25e9) and place_miss(fast_link) == "copy"
    slow_link = MissCosts(EXPERT, HIDDEN, 2e9, cpu_expert_s=400e-6)  # 2.3 ms to copy, 0.4 ms on the CPU
    assert slow_link.cpu_s == pytest.approx(2 * (10e-6 + HIDDEN / 2e9) + 400e-6) and place_miss(slow_link) == "cpu"
    with pytest.raises(ValueError, match="positive link speed"):
        MissCosts(EXPERT, HIDDEN, 0.0, 1e-3)


def test_hybrid_only_on_a_discrete_gpu_where_the_cpu_wins():
    laptop, jetson = load_profile("laptop-rtx4060-8gb"), load_profile("jetson-orin-nano-8gb")
    # 15.75 GB/s: a copy takes 0.3 ms; a CPU at 0.1 ms an expert wins, one at 1 ms does not
    assert miss_compute_for(laptop, EXPERT, HIDDEN, 100e-6) == "hybrid"
    assert miss_compute_for(laptop, EXPERT, HIDDEN, 1e-3) == "device"
    assert miss_compute_for(jetson, EXPERT, HIDDEN, 1e-6) == "device"  # one DRAM: nothing is copied
    assert miss_compute_for(None, EXPERT, HIDDEN, 1e-6) == "device"


def test_the_policy_field_is_validated():
    assert PolicyConfig("x").miss_compute == "device"
    with pytest.raises(PolicyError, match="miss_compute='cpu' is not valid; use one of: device, hybrid"):
        PolicyConfig("x", miss_compute="cpu")


def _plan(expert_s: float) -> Plan:
    link = LinkSpec("disk", 1e9, 1e-4)
    return Plan(PRESETS["fate-edge"], 10.0, 0.5, link, [], HostCosts(1e-3, expert_s=expert_s))


def test_the_planner_picks_hybrid_for_a_discrete_gpu_only():
    assert with_miss_compute(_plan(100e-6), "laptop-rtx4060-8gb", EXPERT, HIDDEN).policy.miss_compute == "hybrid"
    assert with_miss_compute(_plan(1e-3), "laptop-rtx4060-8gb", EXPERT, HIDDEN).policy.miss_compute == "device"
    for device in (None, "jetson-orin-nano-8gb", "orin-nano", "no-such-device"):
        plan = _plan(100e-6)
        assert with_miss_compute(plan, device, EXPERT, HIDDEN) is plan  # the CPU and a Jetson: as before


def test_the_plan_carries_its_measured_miss_costs_to_seed_the_run():
    plan = with_miss_compute(_plan(100e-6), "laptop-rtx4060-8gb", EXPERT, HIDDEN)
    assert plan.miss_costs == MissCosts(EXPERT, HIDDEN, 15.75e9, cpu_expert_s=100e-6)
    rule = MissRule()
    rule.seed(plan.miss_costs)  # what Engine.load does with the scheduler's rule (TierPath.seed_misses)
    assert rule.cpu_row_s == 100e-6 and rule.link_s_per_byte == pytest.approx(1 / 15.75e9)
    assert with_miss_compute(_plan(100e-6), "jetson-orin-nano-8gb", EXPERT, HIDDEN).miss_costs is None


def test_the_planner_and_the_run_decide_alike_on_the_same_numbers():
    """One cost model: the planner's ``hybrid`` pick is the run's per-miss rule, seeded with the plan's costs, for a
    one-row decode miss that no later use repays; a reuse the run expects only leans it toward the copy."""
    laptop = load_profile("laptop-rtx4060-8gb")  # 15.75 GB/s: the copy takes ~0.3 ms
    decisions = set()
    for expert_s in (50e-6, 200e-6, 280e-6, 290e-6, 300e-6, 320e-6, 1e-3):  # both sides of the boundary
        plan = with_miss_compute(_plan(expert_s), "laptop-rtx4060-8gb", EXPERT, HIDDEN)
        costs = plan.miss_costs
        assert costs is not None
        run = MissRule(top_k=2, num_experts=60)  # as the scheduler builds it with no device cache: no reuse
        run.seed(costs)  # TierPath.seed_misses
        assert run.cpu_s(1, HIDDEN) == costs.cpu_s and run.copy_s(EXPERT) == costs.copy_s
        on_cpu = run.choose((3, 7), 1, EXPERT, HIDDEN, prompt=False) == "cpu"
        assert on_cpu == (plan.policy.miss_compute == "hybrid") == (place_miss(costs) == "cpu")
        assert on_cpu == (miss_compute_for(laptop, EXPERT, HIDDEN, expert_s) == "hybrid")
        decisions.add(on_cpu)
        kept = MissRule(top_k=2, num_experts=60, horizon_tokens=30.0)  # a copy that stays cached: uses repay it
        kept.seed(costs)
        assert kept.choose((3, 7), 1, EXPERT, HIDDEN, prompt=False) == "copy" or on_cpu
    assert decisions == {True, False}  # the numbers straddle the boundary
