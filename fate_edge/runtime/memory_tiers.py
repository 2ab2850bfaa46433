"""Two expert budgets, device and host, and when they are one (docs/memory.md, DESIGN §10 "Tiers on a GPU").

On a discrete GPU the experts live in two memories: the device budget (GPU memory: cache slots and the expert
being computed) and the host budget (host memory: the pinned staging buffers reads land in, and a pinned host
tier of experts between the store and the GPU). The staging buffers are host memory: charging them to the device
budget took them out of the GPU's cache for nothing. Pinned memory is rounded up by torch's pinned allocator, so
the host budget charges what it holds (``held_bytes.pinned_held_bytes``).

Where CPU and GPU share one DRAM (a CPU run, a Jetson) the two collapse into one budget: staging and cache come
out of the same memory, and a host tier would only copy what the device can already read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fate_edge.format.blob import ALIGN
from fate_edge.runtime.held_bytes import pinned_held_bytes


@dataclass(frozen=True)
class MemoryTiers:
    """The expert memory of a run, by where it lives (bytes)."""

    device: int  # the device budget: cache slots and the expert being computed (with the staging where unified)
    host: int  # the host budget: pinned staging buffers as held, and the pinned host tier (0 where unified)
    unified: bool  # one DRAM for CPU and compute: the two budgets are one
    host_tier: int = 0  # of ``host``: pinned experts held in host memory between the store and the GPU

    def __post_init__(self) -> None:
        if self.unified and self.host:
            raise ValueError("a unified-memory device has one expert budget: no host budget beside it")
        if not 0 <= self.host_tier <= self.host:
            raise ValueError(f"the host tier ({self.host_tier} bytes) must fit the host budget ({self.host} bytes)")

    @property
    def in_host_memory(self) -> int:
        """Bytes of the experts in host memory (RSS): everything where unified, else the host budget."""
        return self.device if self.unified else self.host

    @property
    def in_device_memory(self) -> int:
        """Bytes of the experts in GPU memory: 0 where unified (the GPU reads host DRAM)."""
        return 0 if self.unified else self.device


def is_unified(device: str, profile: Any = None) -> bool:
    """Whether a run's experts have one memory: a CPU run, or a GPU sharing DRAM with the CPU (``profile``'s
    ``unified_memory`` where a device profile is given, else this board: a Jetson). A discrete CUDA GPU has two."""
    if not device.startswith("cuda"):
        return True
    if profile is not None:
        return bool(profile.unified_memory)
    from fate_edge.devices.detect import is_jetson_board, read_board_model

    return is_jetson_board(read_board_model())


def staging_held(slot_bytes: int, pinned: bool) -> int:
    """Bytes one staging buffer of ``slot_bytes`` holds: pinned ones are over-allocated by ALIGN (for an aligned
    window, ``fetch.buffer_pool.Buffer``) and rounded up by torch's pinned allocator; others hold their size."""
    return pinned_held_bytes(slot_bytes + ALIGN) if pinned else slot_bytes


def plan_tiers(plan: Any, unified: bool, host_tier: int = 0) -> MemoryTiers:
    """The tiers of a ``budget.BudgetPlan``: where unified, the budget is the one memory's (staging inside it, and
    no host tier: the cache already lies in that memory); else the device holds the cache and the expert being
    computed, the host the staging as held and the host tier's slab as held (``host_tier`` bytes)."""
    if unified:
        return MemoryTiers(plan.budget, 0, True)
    return MemoryTiers(plan.cache_bytes + plan.working_bytes, plan.host_bytes + host_tier, False, host_tier)
