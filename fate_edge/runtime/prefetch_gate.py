"""fate-edge's prefetch gate: which prediction ranks are worth a read on this host, from evidence.

A prefetch of a routed expert hides ``per_read`` seconds of stall, but unlike a demand read (during which
compute waits anyway) its reader thread's CPU time competes with compute: ``cost`` = contention x reader
CPU per read, and a wrong prefetch costs only that. Rank r nets q_r x per_read - cost per read, where
q_r is how often rank r's prediction was routed when it was not already cached (only then is a read
needed; that happens at rate u_r per layer). The gate prefetches the leading ranks with a positive net,
if their expected gain per layer, sum of u_r x net_r, beats what running the predictor costs per layer;
otherwise it shuts, and the predictor runs on one layer call in ``EXPLORE`` to keep the evidence current.
Fate's width rule (reads that fit in one layer's compute) then caps the reads, not the ranks (:func:`gated`): a rank
the cache holds takes no read, and on a cache that holds most of what is routed the first ranks mostly are held, so a
cap on ranks left the reads the gate found worth making unmade.
Shared by the scheduler (measured costs) and the simulator (the planner's costs), so both decide alike.
"""

from __future__ import annotations

DECAY = 0.98  # evidence window of about 50 checked predictions
MIN_CHECKS = 16  # before this many, no prefetch: predictions are only checked
EXPLORE = 8


class PrefetchGate:
    def __init__(self, ranks: int):
        self.seen = [0.0] * ranks  # decayed count of checks in which rank r's prediction was not cached
        self.used = [0.0] * ranks  # ... and was routed
        self.checks = 0.0  # decayed count of checked predictions
        self._tick = 0

    def record(self, uncached: dict[int, int], routed: set[int]) -> None:
        """One checked prediction: rank → expert for the ranks not cached when predicted; the true experts."""
        self.checks = DECAY * self.checks + 1.0
        for r in range(len(self.seen)):
            e = uncached.get(r)
            self.seen[r] = DECAY * self.seen[r] + float(e is not None)
            self.used[r] = DECAY * self.used[r] + float(e is not None and e in routed)

    def width(self, width: int, per_read: float, cost: float, predict_cost: float, min_width: int = 0) -> int:
        """How many of the first ``width`` ranks to prefetch (see the module docstring)."""
        if self.checks < MIN_CHECKS:
            return min_width
        n, gain = 0, 0.0
        while n < min(width, len(self.seen)):
            seen = self.seen[n]
            net = (self.used[n] / seen if seen > 1e-9 else 0.0) * per_read - cost
            if net <= 0:
                break
            gain += seen / self.checks * net
            n += 1
        return max(min_width, n if gain > predict_cost else 0)

    def should_predict(self, shut: bool) -> bool:
        """Run the predictor on this layer call? Always while gathering evidence or when the gate is open."""
        if self.checks < MIN_CHECKS or not shut:
            return True
        self._tick = (self._tick + 1) % EXPLORE
        return self._tick == 0


def gated(
    gate: PrefetchGate, reads: int, per_read: float, cost: float, predict_cost: float, min_width: int = 0
) -> tuple[int, int]:
    """(the leading ranks worth a read, at most ``reads`` of them read a layer call): the gate over every rank it
    tracks, the reads from Fate's width rule (``reads``: those that fit in one layer's compute; 0, none)."""
    if reads <= 0:
        return 0, 0
    return gate.width(len(gate.seen), per_read, cost, predict_cost, min_width), reads
