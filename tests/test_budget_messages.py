"""Budget errors print sizes with fate_edge.sizes.format_bytes, and the minimum they advise is enough."""

import re

import pytest

from fate_edge.errors import BudgetError
from fate_edge.runtime.budget import memory_shortfall, parse_bytes, plan_budget
from fate_edge.runtime.policy import PRESETS
from fate_edge.sizes import format_bytes


@pytest.mark.parametrize(
    "n,text",
    [
        (3_464_001, "3.47 MB"),
        (3_500_000, "3.50 MB"),
        (999.2, "1000 B"),
        (12_340_001, "12.4 MB"),
        (41_472, "41.5 KB"),
        (2e9, "2.00 GB"),
    ],
)
def test_round_up_never_shows_less_than_the_size(n, text):
    assert format_bytes(n, round_up=True) == text
    assert parse_bytes(text.replace(" ", "")) >= n


def test_the_advised_minimum_budget_is_accepted():
    # 2 read buffers of 1.232 MB + one 1.000001 MB expert = 3_464_001 bytes: "3.46 MB" rounded to nearest.
    slot, entry = 1_232_000, 1_000_001
    with pytest.raises(BudgetError) as err:
        plan_budget(2_000_000, PRESETS["lru"], entry, slot)
    msg = str(err.value)
    assert msg.startswith("memory budget 2.00 MB is below the minimum 3.47 MB ")
    assert "2 read buffers of 1.23 MB" in msg
    advised = re.search(r"raise --memory-budget to at least (\S+ \S+)$", msg).group(1)
    plan = plan_budget(parse_bytes(advised), PRESETS["lru"], entry, slot)  # the advice fits
    assert plan.minimum == 3_464_001


def test_small_and_large_sizes_get_their_own_unit():
    with pytest.raises(BudgetError, match=r"^memory budget 10.0 KB is below the minimum 2.50 MB "):
        plan_budget(10_000, PRESETS["lru"], 500_000, 1_000_000)
    gb = 10**9
    assert "need up to 3.50 GB" in memory_shortfall(gb // 2, 3 * gb, 2 * gb, None, unified=True)
    assert "only 2.00 GB of memory" in memory_shortfall(gb // 2, 3 * gb, 2 * gb, None, unified=True)
    assert "needs up to 3.00 GB of GPU memory but 512.0 MB is free" in memory_shortfall(
        gb // 2, 3 * gb, 8 * gb, 512_000_000, unified=False
    )
    assert "need 1.50 GB of host memory but only 800.0 MB" in memory_shortfall(
        3 * gb // 2, gb, 800_000_000, 8 * gb, unified=False
    )
