"""``--memory-budget auto``: the budget comes from this machine's free memory (MemAvailable, a cgroup v2 or v1
limit, a discrete GPU's free memory), less the memory account's other parts and a headroom, capped at every expert.
The /proc and /sys files are fakes written here: nothing depends on the host's memory."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from fate_edge.errors import BudgetError
from fate_edge.format.converted_stores import ensure_store
from fate_edge.runtime.auto_budget import (
    HEADROOM_MIN,
    FreeMemory,
    MemorySources,
    choose_budget,
    experts_cap,
    free_memory,
)
from fate_edge.runtime.memory_account import memory_account

MB = 1_000_000


def _sources(tmp: Path, available_kb: int, cgroup: str | None = None, **files: str) -> MemorySources:
    (tmp / "meminfo").write_text(f"MemTotal:       99999999 kB\nMemAvailable:   {available_kb} kB\n")
    (tmp / "cgroup").write_text(cgroup or "0::/\n")
    for rel, text in files.items():
        path = tmp / "sys" / rel.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return MemorySources(tmp / "meminfo", tmp / "cgroup", tmp / "sys")


def test_mem_available_is_read_when_no_cgroup_limits(tmp_path):
    free = free_memory(_sources(tmp_path, 2_000_000, **{"memory.max": "max\n", "memory.current": "5\n"}))
    assert (free.bytes, free.source) == (2_000_000 * 1024, "MemAvailable")


def test_a_cgroup_v2_limit_nearer_than_mem_available_wins(tmp_path):
    src = _sources(
        tmp_path,
        8_000_000,
        "0::/user.slice/run.scope\n",
        **{"user.slice__run.scope__memory.max": "1000000000\n", "user.slice__run.scope__memory.current": "300000000\n"},
    )
    free = free_memory(src)
    assert (free.bytes, free.source) == (700_000_000, "cgroup v2 memory.max")
    assert free.seen["MemAvailable"] == 8_000_000 * 1024


def test_a_cgroup_v1_memory_limit_is_read_and_its_no_limit_value_ignored(tmp_path):
    limited = _sources(
        tmp_path,
        8_000_000,
        "4:cpu,cpuacct:/x\n3:memory:/docker/abc\n",
        **{
            "memory__docker__abc__memory.limit_in_bytes": "600000000\n",
            "memory__docker__abc__memory.usage_in_bytes": "100000000\n",
        },
    )
    assert free_memory(limited).bytes == 500_000_000 and "v1" in free_memory(limited).source
    (tmp_path / "sys/memory/docker/abc/memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "none"
    assert free_memory(limited).source == "MemAvailable"


def test_free_gpu_memory_counts_on_a_discrete_gpu_and_not_on_a_jetson(tmp_path):
    src = _sources(tmp_path, 8_000_000)
    gpu = MemorySources(src.meminfo, src.proc_cgroup, src.cgroup_root, gpu_free=1_500_000_000)
    assert free_memory(gpu).source == "free GPU memory" and free_memory(gpu).bytes == 1_500_000_000
    jetson = MemorySources(src.meminfo, src.proc_cgroup, src.cgroup_root, gpu_free=1_500_000_000, jetson=True)
    assert free_memory(jetson).bytes == 8_000_000 * 1024 and "Jetson" in free_memory(jetson).source


@pytest.fixture(scope="module")
def store(bundled_dir):
    return ensure_store(bundled_dir, progress=False)


def test_the_budget_is_what_the_account_leaves_capped_at_every_expert(store):
    account = memory_account(store, 0, "float32", 4096, runtime=300 * MB)
    others = account.running - account.expert_budget
    cap = experts_cap(store, 4)
    tight = choose_budget(account, cap, FreeMemory(others + HEADROOM_MIN + 5 * MB, "cgroup v2 memory.max"))
    assert tight.budget == 5 * MB < cap
    assert "cgroup v2 memory.max" in tight.line() and "5 MB" in tight.line() and "headroom" in tight.line()
    roomy = choose_budget(account, cap, FreeMemory(16_000 * MB, "MemAvailable"))
    assert roomy.budget == cap and "every expert" in roomy.line()
    assert roomy.headroom == 1_600 * MB  # a tenth of what is free, above the minimum


def test_no_room_for_experts_is_refused_in_mb_naming_the_fixes(store):
    account = memory_account(store, 0, "float32", 4096, runtime=300 * MB)
    with pytest.raises(BudgetError, match=r"MB free \(MemAvailable\) leaves nothing for experts.*--memory-budget"):
        choose_budget(account, experts_cap(store, 4), FreeMemory(100 * MB, "MemAvailable"))


def test_an_engine_with_auto_chooses_says_why_and_an_explicit_budget_wins(store, monkeypatch):
    from fate_edge.runtime.engine import Engine
    from fate_edge.runtime.engine_config import EngineConfig
    from fate_edge.runtime.generate import GenerateConfig

    fake = FreeMemory(HEADROOM_MIN + 400 * MB, "cgroup v2 memory.max")
    monkeypatch.setattr("fate_edge.runtime.engine.free_memory", lambda _sources: fake)
    with Engine(EngineConfig(store, "auto", dtype="float32")) as engine:
        choice = engine.budget_choice
        assert choice is not None and engine.budget == choice.budget > 0
        assert engine.account.expert_budget == engine.budget
        assert engine.account.running - engine.budget + choice.budget + choice.headroom <= fake.bytes
        # a few tokens show the chosen budget runs; unbounded, the tiny model fills the whole room (~1,270 tokens)
        assert engine.generate_text("def f():", GenerateConfig(max_tokens=8))[0] is not None
    with Engine(EngineConfig(store, "4MB", dtype="float32")) as engine:
        assert engine.budget_choice is None and engine.budget == 4 * MB


def test_run_prints_the_chosen_budget_before_loading(store, monkeypatch, capsys):
    from fate_edge.apps.engine_args import EngineOptions, open_engine

    monkeypatch.setattr(
        "fate_edge.runtime.auto_budget.free_memory", lambda _s=None: FreeMemory(HEADROOM_MIN + 300 * MB, "MemAvailable")
    )
    log = io.StringIO()
    with open_engine(EngineOptions(model=str(store), dtype="float32"), log=log, account=log, progress=False) as e:
        text = log.getvalue()
        assert "[memory] expert budget auto:" in text and "MemAvailable" in text
        # the account printed with the chosen budget
        assert re.search(rf"expert budget +{e.budget / 1e6:.0f} MB", text)
