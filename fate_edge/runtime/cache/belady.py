"""Belady's MIN (1966) over a recorded request: the eviction half of the oracle bound.

The future is the recorded run's MoE layer calls in order, each (layer, the experts it uses). A cursor
follows the run call by call, so an expert's next use is known at any moment, the uses still to come in
the call being served included: an expert of this call not yet accessed is needed now and is never the
victim. The experts of one call may be accessed in any order (cached ones first, then reads as they land)
without moving the cursor past the call; any other access moves it to the layer's next call (a run that
strays from the record loses at most that call). As in MIN with bypass, a miss needed again later than the victim
is not cached (at most one per call: the budget holds one expert being computed outside the cache); every other
miss is admitted.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Iterable, Sequence

from fate_edge.runtime.cache.eviction import AccessInfo, EvictionPolicy, Key

NEVER = float("inf")


class Belady(EvictionPolicy):
    """Evict the resident whose next use is farthest in the future (clairvoyant: an upper bound for hit
    rate, not a policy a real system can run)."""

    name = "belady"

    def __init__(self, future: Sequence = ()):
        """``future``: the recorded calls in order as (layer, expert ids), or plain keys (layer, expert), each
        then a call of one expert."""
        self.calls: list[tuple[int, frozenset[Key]]] = []
        for layer, ids in future:
            ids = ids if isinstance(ids, Iterable) else [ids]
            self.calls.append((int(layer), frozenset((int(layer), int(e)) for e in ids)))
        self.uses: dict[Key, list[int]] = defaultdict(list)  # key → indices of the calls using it, ascending
        self.of_layer: dict[int, list[int]] = defaultdict(list)  # layer → indices of its calls, ascending
        for i, (layer, keys) in enumerate(self.calls):
            self.of_layer[layer].append(i)
            for key in keys:
                self.uses[key].append(i)
        self.new_sequence()

    def new_sequence(self) -> None:
        """The recorded request starts again: back to before its first call."""
        self.cur = -1  # index of the call being served
        self.bypassed_in = -2  # the call in which an insert was last declined
        self.done: set[Key] = set()  # keys of the current call already accessed

    def on_access(self, key: Key, hit: bool, info: AccessInfo) -> None:
        layer = key[0]
        here = 0 <= self.cur < len(self.calls) and key in self.calls[self.cur][1] and key not in self.done
        if not here:  # the next call of this layer starts
            calls = self.of_layer.get(layer, [])
            j = bisect_right(calls, self.cur)
            self.cur, self.done = (calls[j] if j < len(calls) else len(self.calls)), set()
        self.done.add(key)

    def next_use(self, key: Key) -> float:
        """Index of the call that uses ``key`` next (this call, while it has not accessed it yet); NEVER if none."""
        uses = self.uses.get(key, [])
        j = bisect_left(uses, self.cur + (key in self.done))
        return uses[j] if j < len(uses) else NEVER

    def victim(self, candidates: Sequence[Key], incoming: Key | None = None) -> Key:
        return max(candidates, key=lambda k: (self.next_use(k), k))

    def admit(self, incoming: Key, victim: Key) -> bool:
        if self.bypassed_in == self.cur or self.next_use(incoming) <= self.next_use(victim):
            return True
        self.bypassed_in = self.cur
        return False
