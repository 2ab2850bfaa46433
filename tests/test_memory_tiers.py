"""Two expert budgets, device and host, in the memory account; one on a unified-memory device (runtime.memory_tiers).

A discrete GPU's read buffers are pinned host memory: they were charged to the device budget, taking their bytes out
of the GPU's cache, and charged at their asked size although torch's pinned allocator rounds each one up."""

import pytest
from fate_edge.devices.profile import load_profile

from fate_edge import GenerateConfig
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.runtime.budget import plan_budget
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge.runtime.memory_account import MemoryAccount
from fate_edge.runtime.memory_tiers import MemoryTiers, is_unified, plan_tiers, staging_held
from fate_edge.runtime.policy import get_policy

MB = 1_000_000
SLOT = 4_612_096  # a Qwen1.5-MoE int4 expert's read buffer


def test_a_discrete_gpus_staging_is_host_memory_outside_its_budget():
    policy = get_policy("fate")
    one = plan_budget(1000 * MB, policy, 4_600_000, SLOT)
    two = plan_budget(1000 * MB, policy, 4_600_000, SLOT, staging_held=staging_held(SLOT, pinned=True))
    assert one.pool_buffers == two.pool_buffers  # the same read buffers...
    assert one.cache_bytes == 1000 * MB - one.pool_bytes - one.working_bytes and one.host_bytes == 0
    assert two.cache_bytes == 1000 * MB - two.working_bytes  # ... none of them out of the GPU's cache
    assert two.host_bytes == two.pool_buffers * (8 << 20)  # each held as the pinned allocator rounds it: 8 MiB
    assert staging_held(SLOT, pinned=False) == SLOT


def test_the_budgets_collapse_into_one_on_a_unified_memory_device():
    jetson, desktop = load_profile("jetson-orin-nano-8gb"), load_profile("desktop-rtx4090")
    assert is_unified("cuda", jetson) and not is_unified("cuda", desktop) and is_unified("cpu")
    plan = plan_budget(1000 * MB, get_policy("fate"), 4_600_000, SLOT, staging_held=8 << 20)
    discrete = plan_tiers(plan, unified=False)
    assert discrete.in_device_memory == plan.cache_bytes + plan.working_bytes
    assert discrete.in_host_memory == plan.host_bytes
    shared = plan_tiers(plan_budget(1000 * MB, get_policy("fate"), 4_600_000, SLOT), unified=is_unified("cuda", jetson))
    assert shared.in_device_memory == 0 and shared.in_host_memory == 1000 * MB  # one DRAM, one budget
    with pytest.raises(ValueError, match="one expert budget"):
        MemoryTiers(10, 5, unified=True)
    with pytest.raises(ValueError, match="host tier"):
        MemoryTiers(10, 5, unified=False, host_tier=6)


def test_the_account_holds_both_budgets_and_counts_only_the_hosts_in_rss():
    base = MemoryAccount(300 * MB, 10 * MB, 20 * MB, 1000 * MB, 30 * MB, 40 * MB, 0, 256)
    discrete = MemoryAccount(
        300 * MB, 10 * MB, 20 * MB, 1000 * MB, 30 * MB, 40 * MB, 0, 256, tiers=MemoryTiers(990 * MB, 80 * MB, False)
    )
    assert base.host_budget == 1000 * MB and base.device_budget == 0
    assert discrete.device_budget == 990 * MB and discrete.host_budget == 80 * MB
    assert discrete.running == base.running - 1000 * MB + 80 * MB
    text = "\n".join(discrete.lines())
    assert "host expert budget" in text and "GPU expert budget" in text


def test_a_cpu_engine_has_one_budget_as_before(tmp_path, bundled_dir):
    out = tmp_path / "s"
    convert(bundled_dir, out, ConvertOptions.full(bits=4, keep_bf16=False), progress=False)
    with Engine(EngineConfig(out, "3MB", "fate", max_batch=1)) as e:
        assert e.account.tiers is not None and e.account.tiers.unified
        assert e.account.host_budget == e.account.expert_budget == e.budget and e.account.device_budget == 0
        assert e.plan.host_bytes == 0 and e.plan.cache_bytes == e.budget - e.plan.pool_bytes - e.plan.working_bytes
        e.generate_text("x = ", GenerateConfig(max_tokens=2, ignore_eos=True))
