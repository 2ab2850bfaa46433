"""The expert memory budget: reading a size, splitting it into read buffers, the expert being computed and
the cache, and saying why a budget cannot fit this machine."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from fate_edge.errors import BudgetError
from fate_edge.runtime.policy import PolicyConfig
from fate_edge.sizes import format_bytes

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 1024, "mib": 1 << 20, "gib": 1 << 30}


def parse_bytes(value: int | float | str) -> int:
    """``"2GB"``, ``"512MiB"``, ``"1.5gb"`` or a number of bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read a byte size from {value!r}; write e.g. 512MB, 2GB or 1.5GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass
class BudgetPlan:
    budget: int
    pool_buffers: int
    pool_bytes: int
    working_bytes: int  # one decoded expert in use that the cache could not keep
    cache_bytes: int
    entry_bytes: int  # one cached expert at the policy's precision
    slots: dict[int, int] = field(default_factory=dict)  # per MoE layer (empty for global / no cache)
    demand_buffers: int = 2  # read buffers prefetches never take (FetchEngine's demand_reserve)
    # Host memory the read buffers hold outside the budget: a discrete GPU's pinned staging (runtime.memory_tiers);
    # 0 where they come out of the budget (one memory: a CPU, a Jetson)
    host_bytes: int = 0
    # Grouped prefill's staging regions at a budget (runtime.staged_prefill): taken from the cache's share
    prefill_staging_bytes: int = 0

    @property
    def staging_on_host(self) -> bool:
        return self.host_bytes > 0

    @property
    def minimum(self) -> int:
        """The least budget the plan needs: read buffers and the expert being computed (the buffers on the host,
        outside it, for a discrete GPU)."""
        return (0 if self.staging_on_host else self.pool_bytes) + self.working_bytes


def plan_budget(
    budget: int,
    policy: PolicyConfig,
    entry_bytes: int,
    slot_bytes: int,
    max_inflight: int = 8,
    min_buffers: int = 2,
    top_k: int = 2,
    staging_held: int = 0,
) -> BudgetPlan:
    """Split ``budget`` into read buffers, the one expert being computed, and the cache.

    ``min_buffers`` read buffers let demand reads proceed whatever prefetches hold; prefetching policies
    get extra buffers, at most ``max_inflight`` and at most lookahead x the widest prefetch the policy issues
    per layer: a tenth of the rest of the budget, but never fewer than lookahead x ``top_k`` (one layer's
    experts per layer ahead) while the rest of the budget holds them, so small budgets still prefetch.

    ``staging_held`` > 0: the read buffers are host memory apart from the budget (a discrete GPU's pinned staging,
    each holding that many bytes: ``memory_tiers.staging_held``); the budget is the device's, all of it cache but
    the expert being computed. 0: the buffers come out of the budget (one memory).
    """
    plan = BudgetPlan(
        budget, min_buffers, min_buffers * slot_bytes, entry_bytes, 0, entry_bytes, demand_buffers=min_buffers
    )
    plan.host_bytes = min_buffers * staging_held
    if budget < plan.minimum:
        raise BudgetError(
            f"memory budget {format_bytes(budget)} is below the minimum {format_bytes(plan.minimum, round_up=True)} "
            f"this model needs for experts at int{policy.bits} ({min_buffers} read buffers of "
            f"{format_bytes(slot_bytes)} and one expert being computed); raise --memory-budget to at least "
            f"{format_bytes(plan.minimum, round_up=True)}"
        )
    if policy.predictor is not None:
        # No more buffers than the policy can have prefetches in flight: the rest of the budget caches.
        width = policy.prefetch_width if isinstance(policy.prefetch_width, int) else policy.max_prefetch_width
        rest = (budget - plan.minimum) // slot_bytes
        share = min(rest, max(policy.lookahead * top_k, int(0.1 * (budget - plan.minimum) // slot_bytes)))
        extra = min(max_inflight, policy.lookahead * width, share)
        plan.pool_buffers += max(0, extra)
        plan.pool_bytes = plan.pool_buffers * slot_bytes
        plan.host_bytes = plan.pool_buffers * staging_held
    plan.cache_bytes = budget - plan.minimum if policy.cache else 0
    return plan


def memory_shortfall(
    host_need: int, device_need: int, host_available: int, device_free: int | None, unified: bool
) -> str | None:
    """Why the expert memory cannot fit, or None. ``unified``: CPU and GPU share one memory (a Jetson, or no
    GPU), so everything is counted against it; a discrete GPU holds the cache and the host the staging."""
    if unified or device_free is None:
        need = host_need + device_need
        if need > host_available:
            return (
                f"the experts need up to {format_bytes(need)} (cache, read buffers and the expert being computed"
                f"{', in the memory CPU and GPU share' if unified and device_free is not None else ''}) but only "
                f"{format_bytes(host_available)} of memory is available; lower --memory-budget or free memory"
            )
        return None
    if device_need > device_free:
        return (
            f"the expert cache needs up to {format_bytes(device_need)} of GPU memory but "
            f"{format_bytes(device_free)} is free; lower --memory-budget or free GPU memory"
        )
    if host_need > host_available:
        return (
            f"the pinned read buffers need {format_bytes(host_need)} of host memory but only "
            f"{format_bytes(host_available)} is available; lower --memory-budget or free memory"
        )
    return None
