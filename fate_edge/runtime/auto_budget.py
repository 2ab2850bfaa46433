"""``--memory-budget auto`` (the default): the expert budget this machine can give, from the memory account.

    budget = min(all experts, free - (resident weights + KV cache at the context length + buffers) - headroom)

``free`` is what this process can still take, the nearest of: the kernel's MemAvailable, a memory cgroup's limit
less its usage (v2 ``memory.max``, v1 ``memory.limit_in_bytes``), and on a discrete GPU the GPU's free memory (where
the cache lives; the host then only holds the read buffers). A Jetson's GPU shares the board's DRAM: MemAvailable
counts for both. The headroom is left to the OS, the page cache the expert reads go through and other processes.
Every source is read through :class:`MemorySources`, so tests inject a fake /proc and /sys.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from fate_edge.errors import BudgetError
from fate_edge.runtime.memory_account import MemoryAccount

HEADROOM_SHARE = 0.10  # of the free memory, left to the OS, the page cache and other processes ...
HEADROOM_MIN = 256 * 1024 * 1024  # ... and never less than this
READ_BUFFERS = 8  # read buffers beyond the experts that the cap leaves room for (the engine's in-flight reads)
_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2^63


@dataclass(frozen=True)
class MemorySources:
    """Where free memory is read (the real files by default; a test points them at its own)."""

    meminfo: Path = Path("/proc/meminfo")
    proc_cgroup: Path = Path("/proc/self/cgroup")
    cgroup_root: Path = Path("/sys/fs/cgroup")
    gpu_free: int | None = None  # bytes free on a discrete GPU (None: no GPU, or one sharing the host's DRAM)
    jetson: bool = False  # the GPU shares the board's DRAM


@dataclass(frozen=True)
class FreeMemory:
    bytes: int
    source: str  # which of the sources was nearest, in words
    seen: dict[str, int] = field(default_factory=dict)  # every source read, for the line


def _mem_available(meminfo: Path) -> int | None:
    try:
        m = re.search(r"^MemAvailable:\s+(\d+) kB", meminfo.read_text(), re.M)
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def _cgroup_room(sources: MemorySources) -> tuple[int, str] | None:
    """(limit - usage, which cgroup) of this process's memory cgroup where it has a limit, v2 or v1."""
    try:
        lines = sources.proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hid, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        try:
            if hid == "0" and controllers == "":  # v2: one unified hierarchy
                group = sources.cgroup_root / path.strip().lstrip("/")
                limit = (group / "memory.max").read_text().strip()
                if limit != "max":
                    return int(limit) - int((group / "memory.current").read_text()), "cgroup v2 memory.max"
            elif "memory" in controllers.split(","):  # v1: the memory controller's own hierarchy
                group = sources.cgroup_root / "memory" / path.strip().lstrip("/")
                v1 = int((group / "memory.limit_in_bytes").read_text())
                if v1 < _NO_LIMIT:
                    return v1 - int((group / "memory.usage_in_bytes").read_text()), "cgroup v1 memory limit"
        except (OSError, ValueError):
            continue
    return None


def memory_sources(device: str) -> MemorySources:
    """Where free memory is read for a run on ``device``: the host's, and a discrete GPU's (where the cache lives)."""
    if not device.startswith("cuda"):
        return MemorySources()
    import torch

    from fate_edge.devices.detect import is_jetson_board, read_board_model

    jetson = is_jetson_board(read_board_model())
    gpu_free = None if jetson else int(torch.cuda.mem_get_info(torch.device(device))[0])
    return MemorySources(gpu_free=gpu_free, jetson=jetson)


def is_auto(budget: int | str) -> bool:
    return isinstance(budget, str) and budget.strip().lower() == "auto"


def free_memory(sources: MemorySources | None = None) -> FreeMemory:
    """The memory this process can still take, and where that figure comes from (the nearest limit wins)."""
    import psutil

    sources = sources or MemorySources()
    seen: dict[str, int] = {}
    available = _mem_available(sources.meminfo)
    if available is None:
        available = int(psutil.virtual_memory().available)
    seen["Jetson shared DRAM (MemAvailable)" if sources.jetson else "MemAvailable"] = available
    room = _cgroup_room(sources)
    if room is not None:
        seen[room[1]] = max(0, room[0])
    if sources.gpu_free is not None and not sources.jetson:
        seen["free GPU memory"] = sources.gpu_free
    source = min(seen, key=lambda k: seen[k])
    return FreeMemory(seen[source], source, seen)


@dataclass(frozen=True)
class BudgetChoice:
    budget: int
    free: FreeMemory
    others: int  # resident weights + KV cache + buffers (+ loading, where it is larger)
    headroom: int
    cap: int  # every expert, with its read buffers
    context_tokens: int

    def line(self) -> str:
        """One line: what was chosen and why (printed by run, chat and serve; logged by the SDK)."""
        mb = lambda n: f"{n / 1e6:.0f} MB"  # noqa: E731
        room = (
            f"{mb(self.free.bytes)} free ({self.free.source}) - {mb(self.others)} for resident weights, KV cache at "
            f"{self.context_tokens} tokens and buffers - {mb(self.headroom)} headroom"
        )
        why = f"every expert; {room} would allow more" if self.budget >= self.cap else room
        return f"[memory] expert budget auto: {mb(self.budget)} ({why}); --memory-budget sets it"


def choose_budget(account: MemoryAccount, cap: int, free: FreeMemory) -> BudgetChoice:
    """The expert budget ``free`` leaves beside ``account``'s other parts (its ``expert_budget`` is ignored) and the
    headroom, at most ``cap``. Free memory is counted beyond what the process holds now (``account.runtime``)."""
    others = max(account.running - account.expert_budget, account.loading)  # the peak's parts but the budget
    headroom = max(HEADROOM_MIN, int(HEADROOM_SHARE * free.bytes))
    budget = min(cap, free.bytes - others - headroom)
    choice = BudgetChoice(budget, free, others, headroom, cap, account.context_tokens)
    if budget <= 0:
        raise BudgetError(
            f"memory budget auto: {free.bytes / 1e6:.0f} MB free ({free.source}) leaves nothing for experts after "
            f"{others / 1e6:.0f} MB of resident weights, KV cache at {account.context_tokens} tokens and buffers "
            f"and {headroom / 1e6:.0f} MB headroom; free memory, lower --context-tokens, or give --memory-budget"
        )
    return choice


def experts_cap(store_dir: str | Path, bits: int) -> int:
    """Every expert of the store at ``bits``, with the read buffers the engine keeps beside its cache."""
    from fate_edge.format.store import ExpertStore

    store = ExpertStore(store_dir)
    if bits not in store.precisions:
        bits = min(store.precisions, key=lambda b: abs(b - 4))
    n = len(store.index["moe_layers"]) * store.index["num_experts"]
    return (n + READ_BUFFERS) * store.precisions[bits].slot_bytes


def resolve_budget(
    store_dir: str | Path,
    budget: int | str,
    dtype,
    context_tokens: int,
    resident_bits: int | None = None,
    embedding_bits: int | None = None,
    device: str = "cpu",
    bits: int = 4,
    prompt_cache: int | str = 0,
) -> int:
    """``budget`` in bytes: a size as given, or for "auto" the choice :func:`choose_budget` makes here."""
    from fate_edge.runtime.budget import parse_bytes
    from fate_edge.runtime.memory_account import memory_account

    if not is_auto(budget):
        return parse_bytes(budget)
    account = memory_account(
        store_dir, 0, dtype, context_tokens, resident_bits, embedding_bits=embedding_bits, prompt_cache=prompt_cache
    )
    return choose_budget(account, experts_cap(store_dir, bits), free_memory(memory_sources(device))).budget
