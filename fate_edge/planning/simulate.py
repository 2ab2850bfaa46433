"""Trace-driven simulation of one policy: the real cache and eviction classes, a timed link, no tensors.

Used by the planner to rank configurations before running them. Each trace row is one decode token
passing through every MoE layer in order. Time model (MoE-Lightning's view of batch-1 decode: bound
by the link, plus what each read costs the host's CPU):

- per layer, compute takes ``layer_compute_s`` (+ ``predict_s`` when a predictor runs); a call's cached experts
  are used first, then its misses (as the engine's scheduler does: what the cache policy sees, in that order);
- a demand read takes max(link transfer, reader CPU); a layer's demand reads start when it routes, one after
  another on the link, and the layer's cached experts (``expert_s`` each) are computed while they travel; then
  each fetched expert, in order of arrival, is waited for (the stall), turned into a callable expert by the main
  thread (``consume_s``) and computed, while the next read travels;
- prefetches issued at layer i travel while layer i computes and are on time if they arrive before
  their layer starts; their reader CPU delays compute by ``contention`` x its time (1 on a host whose
  cores all run compute threads, 0 where readers have idle cores), and using one costs ``consume_s``;
- one link serves all reads, and a demand read goes ahead of queued prefetches (pushing them back); a
  prefetch still on its way when its layer routes is promoted, landing no later than a demand read would;
- as in the scheduler, at most ``max_inflight`` reads are in flight: planned reads beyond wait (deferred) and
  start as this layer's own reads free their room, those left for the next layer dropped at its end;
- the ``oracle`` policy (the bound) prefetches the true experts (prefetch_choice.plan_oracle_prefetches),
  past the last layer the next token's first, over Belady-MIN eviction, at no prediction cost.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import partial

import torch

from fate_edge.devices.link import LinkSpec
from fate_edge.runtime.cache import AccessInfo
from fate_edge.runtime.cache.factory import Resident, build_cache
from fate_edge.runtime.policy import PolicyConfig
from fate_edge.runtime.prefetch_choice import (
    gate_candidates,
    plan_oracle_prefetches,
    plan_prefetches,
    prefetch_width,
    ranked,
    room_ahead,
)
from fate_edge.runtime.prefetch_gate import PrefetchGate, gated


@dataclass
class HostCosts:
    """What the simulator charges, per decoder layer and per expert read (measured, or from a profile)."""

    layer_compute_s: float  # one decoder layer's decode compute with its experts in memory (bookkeeping included)
    predict_s: float = 0.0  # per MoE layer: running the predictor and issuing its prefetches
    read_cpu_s: float = 0.0  # per expert read: the reader thread's CPU (page-cache copy, first-read CRC)
    consume_s: float = 0.0  # per fetched expert: main thread copying it out of its read buffer and decoding it
    contention: float = 1.0  # share of a reader's CPU time that delays compute
    # One routed expert's compute, part of ``layer_compute_s``. A layer's demand reads start when it routes; its
    # cached experts are computed while they travel (the scheduler yields them first), so these hide part of the
    # first read. 0: nothing overlaps (all of a layer's compute before its reads or after them).
    expert_s: float = 0.0
    # Compute slowed by waiting: seconds of extra compute per second of stall. After the main thread sleeps on a
    # read its OpenMP team has gone to sleep too, and the cores and caches it computes on have gone cold, so a
    # token computes slower in a stall-heavy run than in a stall-free one (docs/measured-choices.md). Measured from
    # two probes at different stall levels (host_costs.stall_drag); 0: compute does not depend on stalls.
    stall_drag: float = 0.0

    def describe(self) -> str:
        return (
            f"{self.layer_compute_s * 1e3:.3f} ms compute per layer ({self.expert_s * 1e3:.3f} ms per routed "
            f"expert), {self.predict_s * 1e3:.3f} ms predicting, per read {self.read_cpu_s * 1e3:.3f} ms reader "
            f"CPU (x{self.contention:.2f} contention) + {self.consume_s * 1e3:.3f} ms decode, "
            f"+{self.stall_drag:.2f} s compute per s of stall"
        )


@dataclass
class SimResult:
    tokens: int
    hits: int
    prefetch_hits: int
    misses: int
    stall_s: float
    demand_bytes: int
    prefetch_bytes: int
    wasted_bytes: int
    total_s: float
    prefetched: list[tuple[int, int, int]] = field(default_factory=list)  # (token, layer, expert) per read issued
    prompt_prefetches: int = 0  # reads the prompt's last layer issued for the first token (the oracle's)
    late_prefetches: int = 0  # prefetch hits that had not arrived when their layer routed (compute stalled)
    layer_misses: dict[int, int] = field(default_factory=dict)  # MoE layer → demand reads (where the stall is)

    @property
    def hit_rate(self) -> float:
        uses = self.hits + self.prefetch_hits + self.misses
        return (self.hits + self.prefetch_hits) / uses if uses else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total_s if self.total_s > 0 else 0.0


def simulate(
    expert_ids: dict[int, torch.Tensor],
    predictions: dict[tuple[int, int], torch.Tensor] | None,
    policy: PolicyConfig,
    cache_bytes: int,
    expert_bytes: int,
    link: LinkSpec,
    costs: HostCosts | float,
    num_experts: int,
    num_layers: int,
    warm: dict[int, list[int]] | None = None,
    max_inflight: int | None = None,
    popularity: dict[int, list[int]] | None = None,
    resident: Resident | None = None,
    preload: dict[int, list[int]] | None = None,
) -> SimResult:
    """``expert_ids``: MoE layer → [N, k] true experts; ``predictions``: (source, target) → [N, E] scores
    (None: no prefetch). ``costs``: a :class:`HostCosts`, or just the per-layer compute seconds (reads then
    cost only link time). ``warm``: experts per layer the prompt's prefill loaded, in load order; they fill
    the cache first, untimed, as the engine's prefill leaves it. ``max_inflight``: at most this many prefetches
    in flight (the engine's read buffers beyond the two kept for demand reads). ``popularity``: the calibration
    counts the engine seeds its cache policy with (``Engine.popularity``). ``resident``: Fate's first layer held
    whole in its own partition (``Engine._resident``); ``preload``: experts per layer the engine caches at load
    (``Engine._preload``), inserted before the prompt's, untimed; under ``keep_preloaded`` the prompt's then enter
    only free room. Returns totals over the N tokens. What to prefetch is prefetch_choice.py's decision, the
    scheduler's own."""
    if not isinstance(costs, HostCosts):
        costs = HostCosts(float(costs))
    layer_compute_s = costs.layer_compute_s
    read_time = max(link.transfer_time(expert_bytes), costs.read_cpu_s)
    prefetch_cpu = costs.contention * costs.read_cpu_s
    layers = sorted(expert_ids)
    n, k = next(iter(expert_ids.values())).shape
    # Belady's future: every call in order, the prompt's (the warm fill) first, as the engine's trace has it.
    future = [(layer, warm[layer]) for layer in layers if layer in warm] if warm else []
    future += [(layer, sorted(expert_ids[layer][t].tolist())) for t in range(n) for layer in layers]
    cache = build_cache(policy, cache_bytes, expert_bytes, layers, num_experts, future, popularity, resident, top_k=k)
    oracle = policy.predictor == "oracle"
    if oracle:  # clairvoyant: the true experts themselves, as the engine's OraclePredictor replays them
        predictions = truth_scores(expert_ids, layers, policy.lookahead, num_experts)
    transfer = link.transfer_time(expert_bytes)
    base_width = prefetch_width(policy, k, layer_compute_s, read_time)
    r = SimResult(n, 0, 0, 0, 0.0, 0, 0, 0, 0.0)
    if cache is not None and preload:
        for layer, experts in preload.items():  # as preload.preload: a layer stops at the first refused insert
            for e in experts:
                if not cache.insert((layer, e), None, expert_bytes, policy.bits):
                    break
    if cache is not None and warm:
        for layer in layers:
            info = AccessInfo(layer_now=layer, num_layers=num_layers)
            pinned = []
            for e in warm.get(layer, []):
                key = (layer, e)
                if key in cache:
                    cache.access(key, True, info)
                else:
                    cache.access(key, False, info)
                    # keep_preloaded: the prompt's reads enter only free room (Scheduler, in prefill)
                    if policy.keep_preloaded and not cache.has_room(key, expert_bytes):
                        continue
                    if not cache.insert(key, None, expert_bytes, policy.bits):
                        continue
                cache.pin(key)  # as in the engine's prefill: a layer's experts are all in use until it is computed
                pinned.append(key)
            for key in pinned:
                cache.unpin(key)

    def cached(key: tuple[int, int]) -> bool:
        return cache is not None and key in cache

    def cached_in(layer: int, expert: int) -> bool:
        return cached((layer, expert))

    clock, link_free = 0.0, 0.0
    inflight: dict[tuple[int, int], float] = {}  # prefetched key → arrival time
    # fate-edge's gate, deciding from the same evidence the scheduler gathers (prefetch_gate.py)
    gate = PrefetchGate(max(policy.max_prefetch_width, k)) if policy.prefetch_gate and predictions else None
    candidates: dict[int, dict[int, int]] = {}  # target layer → rank → expert not cached when predicted
    deferred: list[tuple[int, int]] = []  # planned reads waiting for room (Scheduler.deferred), in order

    def issue(t: int, clock: float, link_free: float) -> tuple[float, float]:
        """Start waiting reads in order while fewer than ``max_inflight`` are in flight (Scheduler._issue_deferred)."""
        while deferred and (max_inflight is None or len(inflight) < max_inflight):
            key = deferred.pop(0)
            link_free = max(link_free, clock) + transfer
            inflight[key] = link_free
            if t >= 0:
                r.prefetched.append((t, *key))
            else:
                r.prompt_prefetches += 1
            clock += prefetch_cpu  # the reader thread takes a core from compute
        return link_free, clock

    if oracle and n:  # the prompt's last layer read token 0's first layers ahead (OraclePredictor.targets)
        first = [(target, one_hot(expert_ids[target][:1], num_experts)) for target in layers[: policy.lookahead]]
        deferred.extend((p.layer, p.expert) for p in plan_oracle_prefetches(first, cached, max_inflight))
        link_free, clock = issue(-1, clock, link_free)
        deferred.clear()
    for t in range(n):
        for li, layer in enumerate(layers):
            info = AccessInfo(layer_now=layer, num_layers=num_layers)
            row = expert_ids[layer][t].tolist()
            routed_s = min(layer_compute_s, len(row) * costs.expert_s)  # the experts' share of the layer's compute
            clock += layer_compute_s - routed_s  # attention and routing: before any read of this layer starts
            route, used, demands, arrivals, hits = clock, [], 0, [], 0
            for _, e in sorted((not cached((layer, e)), e) for e in row):  # hits first
                key = (layer, e)
                if cache is not None and key in cache:
                    r.hits += 1
                    hits += 1
                    cache.access(key, True, info)
                    cache.pin(key)
                    used.append(key)
                    continue
                if key in inflight:
                    # Needed now: the engine promotes a read still queued to demand priority (Scheduler.on_route),
                    # so it lands no later than a demand read issued now would.
                    arrival = min(inflight.pop(key), route + read_time)
                    r.late_prefetches += arrival > route
                    r.prefetch_hits += 1
                    r.prefetch_bytes += expert_bytes
                else:
                    start = route + demands * read_time  # one demand read after another on the link
                    arrival = start + read_time
                    demands += 1
                    r.misses += 1
                    r.layer_misses[layer] = r.layer_misses.get(layer, 0) + 1
                    r.demand_bytes += expert_bytes
                    # The demand read jumps the queue: later prefetches arrive that much later.
                    inflight = {kk: (a + transfer if a > start else a) for kk, a in inflight.items()}
                    link_free = max(link_free, start) + transfer
                arrivals.append(arrival - route)
                if cache is not None:
                    cache.access(key, False, info)
                    if cache.insert(key, None, expert_bytes, policy.bits):
                        cache.pin(key)
                        used.append(key)
            # The cached experts are computed first; each fetched one is waited for, decoded and computed in order
            # of arrival while the next travels. The stall is the waiting plus the decoding (as before: the main
            # thread's time on fetched experts); the experts' compute is charged below with the layer's.
            cpu, stall = hits * costs.expert_s, 0.0
            for a in sorted(arrivals):
                wait = max(0.0, a - cpu)
                cpu += wait + costs.consume_s + costs.expert_s
                stall += wait + costs.consume_s
            clock += stall * (1 + costs.stall_drag)  # the wait, and the slower compute after it
            r.stall_s += stall
            width, predict, reads = base_width, predictions is not None, None
            if gate is not None:
                if layer in candidates:
                    gate.record(candidates.pop(layer), set(expert_ids[layer][t].tolist()))
                width, reads = gated(
                    gate, base_width, read_time, prefetch_cpu, costs.predict_s, policy.min_prefetch_width
                )
                predict = gate.should_predict(shut=width == 0)
            if predict:
                assert predictions is not None  # predict is only ever set where there are predictions
                targets = [
                    (target, predictions[(layer, target)][t : t + 1])
                    for target in layers[li + 1 : li + 1 + policy.lookahead]
                    if (layer, target) in predictions
                ]
                if oracle and t + 1 < n:  # past the last layer: the next token's first ones (OraclePredictor.targets)
                    targets += [
                        (target, one_hot(expert_ids[target][t + 1 : t + 2], num_experts))
                        for target in layers[: policy.lookahead - len(targets)]
                    ]
                if gate is not None and targets:
                    target, scores = targets[0]
                    candidates[target] = gate_candidates(ranked(scores[0]), len(gate.seen), partial(cached_in, target))

                def busy(key: tuple[int, int], inflight=inflight) -> bool:
                    return cached(key) or key in inflight or key in deferred

                room = None if max_inflight is None else room_ahead(max_inflight, (*inflight, *deferred), layer)
                if reads is not None:  # the gate's ranks, Fate's width in reads (prefetch_gate.gated)
                    room = reads if room is None else min(room, reads)
                plan = plan_prefetches(policy, targets, k, width, busy, room)
                deferred.extend((p.layer, p.expert) for p in plan)
                link_free, clock = issue(t, clock, link_free)
                clock += 0.0 if oracle else costs.predict_s  # the bound knows the future without computing it
            clock += routed_s
            if cache is not None:
                for key in used:
                    cache.unpin(key)
            for key in [kk for kk in inflight if kk[0] == layer]:  # predicted for this layer, unused
                arrival = inflight.pop(key)
                done = min(1.0, max(0.0, 1 - (arrival - clock) / transfer))
                r.wasted_bytes += int(done * expert_bytes)
            # As Scheduler.end_layer: the room this layer freed goes to waiting reads, the rest of the next layer's
            # are left to its demand reads.
            link_free, clock = issue(t, clock, link_free)
            nxt = layers[li + 1] if li + 1 < len(layers) else layer
            deferred[:] = [kk for kk in deferred if kk[0] > nxt]
    r.total_s = clock
    return r


def truth_scores(
    expert_ids: dict[int, torch.Tensor], layers: list[int], lookahead: int, num_experts: int
) -> dict[tuple[int, int], torch.Tensor]:
    """The oracle's scores, (source, target) → [N, E]: each token's true experts of the ``lookahead`` MoE layers
    after the source (:func:`one_hot`)."""
    return {
        (src, target): one_hot(expert_ids[target], num_experts)
        for i, src in enumerate(layers)
        for target in layers[i + 1 : i + 1 + lookahead]
    }


def one_hot(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Expert ids [N, k] → scores [N, E], each row's experts at 1/k (what OraclePredictor returns for a call)."""
    return torch.zeros(ids.shape[0], num_experts).scatter_(1, ids, 1.0 / ids.shape[1])


def scale_costs(costs: HostCosts, factor: float) -> HostCosts:
    """``costs`` on a timeline ``factor`` times as long: device-faithful emulation (planning/emulation.py) runs
    the device's timeline k times slower on this host, so ``factor`` = 1 / k turns costs measured under emulation
    into the device's. ``contention`` and ``stall_drag`` are shares, not times, and stay."""
    return dataclasses.replace(
        costs,
        layer_compute_s=costs.layer_compute_s * factor,
        predict_s=costs.predict_s * factor,
        read_cpu_s=costs.read_cpu_s * factor,
        consume_s=costs.consume_s * factor,
    )
