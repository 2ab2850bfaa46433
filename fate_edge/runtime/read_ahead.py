"""A scheduler's reads ahead: each layer call's prefetch width (Fate's rule, measured), fate-edge's gate over it, the
prediction for the layers ahead (one decode row's in one native call where the predictor has it) and the plan of
reads it makes (``prefetch_choice``), and the check of each prediction when its layer routes.

A mixin of :class:`~fate_edge.runtime.scheduler.Scheduler`, whose state it shares (declared below), as
``runtime.resident_layers`` is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from fate_edge.fetch.fetch_engine import Priority
from fate_edge.runtime.prefetch_choice import (
    Prefetch,
    gate_candidates,
    plan_prefetches,
    plan_ranked,
    prefetch_width,
    ranked,
    room_ahead,
)
from fate_edge.runtime.prefetch_gate import PrefetchGate, gated

if TYPE_CHECKING:
    from fate_edge.format.store import ExpertStore
    from fate_edge.model.arch.base import ModelConfig
    from fate_edge.predictors.base import Predictor
    from fate_edge.runtime.cache import ExpertCache
    from fate_edge.runtime.policy import PolicyConfig
    from fate_edge.runtime.scheduler_stats import SchedulerStats

Key = tuple[int, int]


class ReadAhead:
    policy: PolicyConfig
    config: ModelConfig
    cache: ExpertCache | None
    predictor: Predictor | None
    store: ExpertStore
    stats: SchedulerStats
    gate: PrefetchGate
    cold_bits: int | None
    max_inflight: int
    prefetches: dict[Key, Any]
    deferred: dict[Key, Any]
    demands: dict[Key, Any]
    last_prediction: dict[int, list[int]]
    _candidates: dict[int, dict[int, int]]
    _prefill: bool
    _gate: bool
    _layer_time: float
    _read_bw: float
    _read_cpu: float
    _contention: float
    _predict_cost: float
    _reads: int | None

    # Scheduler's
    def _cached(self, key: Key) -> bool:
        raise NotImplementedError

    def _issue_deferred(self) -> None:
        raise NotImplementedError

    def _targets_full(self, layer: int) -> bool:
        """Fate: a prediction is pointless when every layer it targets is fully cached (nothing to read)."""
        if not self.policy.skip_full or self.cache is None or self.predictor is None:
            return False
        targets = self.predictor.targets(layer)
        return bool(targets) and all(self.cache.holds_layer(t, self.config.num_experts) for t in targets)

    def _check_prediction(self, layer: int, idx: torch.Tensor, prompt: bool) -> None:
        pred = self.last_prediction.pop(layer, None)
        if pred is None or prompt:
            self._candidates.pop(layer, None)
            return
        true = set(idx[0].tolist())
        # The gate's evidence: of the predictions that were not already cached (a read would have been
        # needed), how often each rank was routed.
        self.gate.record(self._candidates.pop(layer, {}), true)
        self.stats.predictions += 1
        self.stats.exact += int(set(pred[: len(true)]) == true)
        self.stats.recall_sum += len(true & set(pred[: len(true)])) / len(true)

    # ---------------------------------------------------------------- prefetch
    def _width(self) -> int:
        """This layer call's prefetch width (prefetch_choice.py), from the measured layer and read times."""
        p = self.policy
        per_read = self.store.expert_bytes(p.bits) / self._read_bw if self._read_bw > 0 else 0.0
        width = prefetch_width(p, self.config.num_experts_per_tok, self._layer_time, per_read)
        self._reads = None
        if self._gate and self._layer_time > 0 and per_read > 0:
            return self._gated(width, per_read)
        return width

    def _gated(self, width: int, per_read: float) -> int:
        """fate-edge: the leading ranks whose measured hit rate pays for the reader CPU, ``width`` reads of them at
        most (prefetch_gate.gated, which :meth:`_prefetch` caps the plan's reads by)."""
        if self._read_cpu == 0:
            return 0  # no read measured yet
        ranks, self._reads = gated(
            self.gate,
            width,
            per_read,
            self._contention * self._read_cpu,
            self._predict_cost,
            self.policy.min_prefetch_width,
        )
        return ranks

    def _should_predict(self, prompt: bool, width: int) -> bool:
        """Always in prefill and for ungated policies; with the gate shut, one layer call in 8."""
        if prompt or not self._gate:
            return True
        return self.gate.should_predict(shut=width == 0)

    def _prefetch(self, layer: int, h: torch.Tensor, width: int) -> None:
        """Prefetch what prefetch_choice.py picks for the predicted layers, ``width`` (:meth:`_width`) per layer."""
        assert self.predictor is not None  # called only with one
        targets = self.predictor.targets(layer)
        if not targets:
            return
        k = self.config.num_experts_per_tok
        room = room_ahead(self.max_inflight, (*self.prefetches, *self.deferred), layer)
        if self._reads is not None and not self._prefill:  # the gate's ranks, Fate's width in reads
            room = min(room, self._reads)
        one = len(targets) == 1 and self.policy.prefetch_width != "mass" and self.policy.predictor != "oracle"
        if one and not self._prefill:
            top = self.predictor.top_row(layer, h, max(width, k, len(self.gate.seen)))
            if top is not None:  # one decode row, its next layer's ranking in one native call
                target, ranks = top
                self._note_prediction(target, ranks)
                self._plan(plan_ranked(target, ranks, width, self._busy_key, room))
                return
        pred = self.predictor.predict(layer, h)
        if not self._prefill and pred.layers:
            self._note_prediction(pred.layers[0], ranked(pred.scores[0][0]))

        plan = plan_prefetches(
            self.policy,
            list(zip(pred.layers, pred.scores)),
            k,
            width,
            self._busy_key,
            room=room,
            use_cold=self.cold_bits is not None,
        )
        self._plan(plan)

    def _note_prediction(self, target: int, ranks: list[int]) -> None:
        """A decode row's prediction for ``target`` (its experts ranked), checked when the target routes: exact
        match, and each rank's hit rate where it was not cached (the gate's evidence)."""
        self.last_prediction[target] = ranks[: self.config.num_experts_per_tok]
        self._candidates[target] = gate_candidates(ranks, len(self.gate.seen), lambda e: self._cached((target, e)))

    def _busy_key(self, key: Key) -> bool:
        """Cached, or read, wanted or planned already: never read twice."""
        return self._cached(key) or key in self.prefetches or key in self.demands or key in self.deferred

    def _plan(self, plan: list[Prefetch]) -> None:
        """Planned reads ahead, in the policy's precision (a cold tail in its cold one), issued while room lasts."""
        for p in plan:
            bits = self.cold_bits if p.cold and self.cold_bits is not None else self.policy.bits
            self.deferred[(p.layer, p.expert)] = (bits, Priority.NEXT_LAYER if p.distance == 0 else Priority.AHEAD)
        self._issue_deferred()
