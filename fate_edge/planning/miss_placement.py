"""Where a missed expert is computed on a discrete GPU: copied to the device, or run on the CPU.

A miss the host holds (the pinned host tier) can be copied over the link and computed on the GPU, or computed where
it lies, on the CPU's int4 kernel, with only the token's hidden state sent across and the output sent back
(llama.cpp ``--cpu-moe``, Fiddler, KTransformers). Which is cheaper follows from measured speeds: the link's
bandwidth and latency against the CPU's time for one expert of one token. A policy with ``miss_compute="hybrid"``
lets the runtime choose per miss; the planner picks it where the measured costs say the CPU wins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fate_edge.runtime.miss_rule import DEFAULT_LINK_LATENCY_S, MissRule


@dataclass(frozen=True)
class MissCosts:
    """What serving one missed expert of one token costs each way (bytes, seconds, bytes per second)."""

    expert_bytes: int  # the expert's blob: what a copy moves
    hidden_bytes: int  # one token's hidden state: what computing on the CPU moves, each way
    link_bytes_per_s: float  # host → device copies, measured
    cpu_expert_s: float  # the CPU's kernel on one expert for one token, measured
    device_expert_s: float = 0.0  # the GPU's compute of it once it is there
    link_latency_s: float = DEFAULT_LINK_LATENCY_S

    def __post_init__(self) -> None:
        if self.link_bytes_per_s <= 0 or min(self.expert_bytes, self.hidden_bytes) < 0 or self.cpu_expert_s < 0:
            raise ValueError(f"miss costs need a positive link speed and sizes and times >= 0, got {self}")

    def rule(self) -> MissRule:
        """The run's per-miss rule (``runtime.miss_rule``) seeded with these figures, keeping no copy (no reuse): the
        one cost model, of which the planner's one-row miss is a special case."""
        rule = MissRule(learn=0.0)
        rule.seed(self)
        return rule

    @property
    def copy_s(self) -> float:
        """Copy the expert to the GPU and compute it there."""
        return self.rule().copy_s(self.expert_bytes)

    @property
    def cpu_s(self) -> float:
        """Send the hidden state to the CPU, compute the expert there, send its output back (one row)."""
        return self.rule().cpu_s(1, self.hidden_bytes)


def place_miss(costs: MissCosts) -> str:
    """``"cpu"`` where computing the miss on the CPU is cheaper than copying it, else ``"copy"``: the run's rule
    for one row of a decode miss, no reuse (a copy is not counted on to serve later uses)."""
    return costs.rule().choose((0, 0), 1, costs.expert_bytes, costs.hidden_bytes, prompt=False)


def miss_compute_for(
    profile: Any, expert_bytes: int, hidden_bytes: int, cpu_expert_s: float, device_expert_s: float = 0.0
) -> str:
    """The ``miss_compute`` a policy should take on the device of ``profile`` (devices/profile.py): ``"hybrid"``
    where it has a host link (a discrete GPU) and a miss is cheaper on the CPU at the measured ``cpu_expert_s``;
    ``"device"`` on one memory (a Jetson, a CPU: nothing to copy) or where the link wins."""
    if profile is None or profile.unified_memory or profile.host_link_gbps is None or cpu_expert_s <= 0:
        return "device"
    costs = MissCosts(expert_bytes, hidden_bytes, profile.host_link_gbps * 1e9, cpu_expert_s, device_expert_s)
    return "hybrid" if place_miss(costs) == "cpu" else "device"
