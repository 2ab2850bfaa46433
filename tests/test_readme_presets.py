"""The docs and the code agree: the presets tables (one line each in the README, in full in docs/architecture.md)
name each preset's eviction and allocation as policy.py sets them."""

import re
from pathlib import Path

import pytest

from fate_edge.runtime.policy import PRESETS

ROOT = Path(__file__).resolve().parents[1]
TABLES = [ROOT / "README.md", ROOT / "docs" / "architecture.md"]
EVICTIONS = {"lru": "LRU", "lfu": "LFU", "arc": "ARC", "lcu": "LCU", "belady": "Belady", "popularity": "popularity"}


def _preset_rows(page: Path) -> dict[str, str]:
    rows = {}
    for line in page.read_text().splitlines():
        m = re.match(r"\| `([a-z0-9-]+)`(?: / `([a-z0-9-]+)`)? \| (.+) \|$", line)
        if m:
            for name in filter(None, m.group(1, 2)):
                rows[name] = m.group(3)
    return rows


@pytest.mark.parametrize("page", TABLES, ids=lambda p: p.name)
def test_the_docs_list_every_preset(page):
    assert set(PRESETS) <= set(_preset_rows(page))


@pytest.mark.parametrize("page", TABLES, ids=lambda p: p.name)
def test_the_docs_name_the_eviction_and_allocation_each_cached_preset_uses(page):
    rows = _preset_rows(page)
    for name, policy in PRESETS.items():
        if not policy.cache:
            assert "nothing kept" in rows[name], name
            continue
        text = rows[name].split("(")[0]  # the claim, before any parenthesised comparison with other policies
        named = {e for e, word in EVICTIONS.items() if re.search(rf"\b{word}\b", text)}
        assert named == {policy.eviction}, f"{page.name} row for {name} names {named}, policy.py uses {policy.eviction}"
        shallow = "shallow-favoring" in text
        assert shallow == (policy.allocation == "shallow"), (
            f"{page.name} row for {name}: allocation {policy.allocation}"
        )
