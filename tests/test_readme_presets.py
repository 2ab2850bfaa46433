"""README and code agree: the presets table names each preset's eviction and allocation as policy.py sets them."""

import re
from pathlib import Path

from fate_edge.runtime.policy import PRESETS

README = Path(__file__).resolve().parents[1] / "README.md"
EVICTIONS = {"lru": "LRU", "lfu": "LFU", "arc": "ARC", "lcu": "LCU", "belady": "Belady", "popularity": "popularity"}


def _preset_rows() -> dict[str, str]:
    rows = {}
    for line in README.read_text().splitlines():
        m = re.match(r"\| `([a-z0-9-]+)`(?: / `([a-z0-9-]+)`)? \| (.+) \|$", line)
        if m:
            for name in filter(None, m.group(1, 2)):
                rows[name] = m.group(3)
    return rows


def test_readme_lists_every_preset():
    assert set(PRESETS) <= set(_preset_rows())


def test_readme_names_the_eviction_and_allocation_each_cached_preset_uses():
    rows = _preset_rows()
    for name, policy in PRESETS.items():
        if not policy.cache:
            assert "nothing kept" in rows[name], name
            continue
        text = rows[name].split("(")[0]  # the claim, before any parenthesised comparison with other policies
        named = {e for e, word in EVICTIONS.items() if re.search(rf"\b{word}\b", text)}
        assert named == {policy.eviction}, f"README row for {name} names {named}, policy.py uses {policy.eviction}"
        shallow = "shallow-favoring" in text
        assert shallow == (policy.allocation == "shallow"), f"README row for {name}: allocation {policy.allocation}"
