"""What the scheduler counts: expert uses by where they came from, reads, stalls and the main thread's time."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class SchedulerStats:
    hits: int = 0  # served from the cache
    prefetch_hits: int = 0  # served by a prefetch issued before the layer needed it
    misses: int = 0  # demand fetches on the critical path
    skipped: int = 0  # dropped by precision-on-miss past T2 (opt-in)
    low_precision: int = 0  # expert uses served in the cold precision
    stall_s: float = 0.0  # time the forward pass waited for expert bytes
    demand_bytes: int = 0  # bytes read on the critical path
    prefetch_bytes: int = 0  # bytes read ahead (overlapped with compute)
    wasted_bytes: int = 0  # prefetched bytes never used
    predictions: int = 0  # decode-time predictions checked against the true next-layer experts
    exact: int = 0  # ... whose top-k set equalled the true set
    recall_sum: float = 0.0  # ... summed recall of the true experts in the predicted top-k
    consume_s: float = 0.0  # main thread turning fetched blobs into callable experts (copy out + decode)
    predict_s: float = 0.0  # running the predictor and issuing prefetches
    predictions_skipped: int = 0  # predictor calls left out: every layer they target was fully cached (Fate)
    # Decode: the caller's compute of cached experts (from yielding one to being asked for the next). These run
    # while the layer's reads travel, so they hide part of a read (the simulator's HostCosts.expert_s).
    expert_s: float = 0.0
    experts_timed: int = 0
    # Tiers on a GPU (runtime.host_tier): misses served from the host tier (no store read), misses computed on the
    # CPU where they lie (policy miss_compute="hybrid"), prefetches made ready as their read landed
    host_hits: int = 0
    cpu_computed: int = 0
    copied_up: int = 0  # ... host-held misses the hybrid rule copied up instead (runtime.miss_rule)
    landed_early: int = 0

    def snapshot(self) -> SchedulerStats:
        return SchedulerStats(**{f.name: getattr(self, f.name) for f in fields(self)})

    def minus(self, other: SchedulerStats) -> SchedulerStats:
        return SchedulerStats(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    @property
    def uses(self) -> int:
        return self.hits + self.prefetch_hits + self.misses

    @property
    def hit_rate(self) -> float:
        """Share of expert uses served without a demand read (cache or timely prefetch)."""
        return (self.hits + self.prefetch_hits) / self.uses if self.uses else 0.0

    @property
    def exact_match(self) -> float:
        return self.exact / self.predictions if self.predictions else 0.0

    @property
    def prediction_summary(self) -> str:
        """How the cross-layer predictions went, for a stats line: none made is said as such, not as 0% exact."""
        if self.predictions:
            return f"prediction exact {100 * self.exact_match:.0f}%"
        if self.predictions_skipped:
            return "no prediction needed (the experts it would name cached)"
        return "no prediction made"

    @property
    def recall(self) -> float:
        return self.recall_sum / self.predictions if self.predictions else 0.0
