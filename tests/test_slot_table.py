"""The cache as fixed slots with a (layer, expert) → slot table (model/slot_table.py), on the CPU."""

import random

import pytest
import torch

from fate_edge.errors import BudgetError
from fate_edge.model.slot_table import SlotTable
from fate_edge.runtime.cache import LRU, ExpertCache


def test_slots_are_handed_out_once_and_reused_after_eviction():
    t = SlotTable(3, [1, 3], 4)
    assert [t.admit(k) for k in [(1, 0), (3, 2), (1, 3)]] == [0, 1, 2]
    assert t.admit((3, 2)) == 1  # already held: its own slot
    with pytest.raises(BudgetError, match="all 3 expert slots are taken"):
        t.admit((1, 1))
    assert t.release((3, 2)) == 1 and t.release((3, 2)) is None
    assert t.admit((1, 1)) == 1 and len(t) == 3 and t.free == 0
    with pytest.raises(KeyError, match="layer 2"):
        t.admit((2, 0))


def test_the_graph_sees_changes_only_when_committed():
    t = SlotTable(4, [0, 1], 8)
    t.admit((1, 5))
    ids = torch.tensor([5, 2])
    assert t.lookup(1, ids).tolist() == [-1, -1]  # not committed: the token under way reads the old table
    t.commit()
    assert t.lookup(1, ids).tolist() == [0, -1] and t.lookup(0, ids).tolist() == [-1, -1]
    t.release((1, 5))
    t.commit()
    assert t.lookup(1, ids).tolist() == [-1, -1] and not t.dirty


def test_a_random_run_against_a_dict_model():
    rng = random.Random(0)
    t = SlotTable(5, [0, 2, 4], 6)
    model: dict[tuple[int, int], int] = {}
    for _ in range(400):
        key = (rng.choice([0, 2, 4]), rng.randrange(6))
        if key in model and rng.random() < 0.5:
            assert t.release(key) == model.pop(key)
        elif key not in model and len(model) < 5:
            model[key] = t.admit(key)
        t.commit()
        assert len(set(model.values())) == len(model) and all(0 <= s < 5 for s in model.values())
        for layer in (0, 2, 4):
            want = [model.get((layer, e), -1) for e in range(6)]
            assert t.lookup(layer, torch.arange(6)).tolist() == want


def test_the_caches_evictions_free_their_slots():
    cache = ExpertCache({0: 3 * 100}, lambda p, n: LRU(), 100)
    t = SlotTable(3, [0], 16)
    t.attach(cache)
    for e in range(10):
        assert cache.insert((0, e), object(), 100, 4)
        t.admit((0, e))
        t.commit()
        assert set(t._slot_of) == set(cache.entries)  # every cached expert in a slot, nothing else
    assert t.lookup(0, torch.tensor([9, 8, 7, 0])).tolist()[-1] == -1
