"""Which experts to prefetch: the one decision the scheduler (real reads) and the simulator (the planner) share.

Pure functions of (policy, predicted scores, k, width, what is already cached or in flight): the planner ranks
policies by simulating exactly the choice the engine will make, so the two cannot drift apart.

- width: the policy's number, Fate's rule (reads that fit into one layer's compute time), or for "mass"
  its cap; the prefetch gate (prefetch_gate.py) may narrow it further;
- decode (one token): the most probable experts up to the width, or the smallest set reaching the
  policy's probability mass; experts scored 0 (the oracle's unused ones) are never worth a read;
- prefill (many tokens): the union of every token's predicted top-k, most popular first, the least
  popular tail (up to ``cold_tail_mass`` of all assignments) in the cold precision (only prefetches travel
  cold: the scheduler reads a prefill miss in the policy's precision, as Fate does);
- order: nearest target layer first, then highest score; an expert cached or in flight is skipped,
  and no more than ``room`` reads are issued;
- the oracle (:func:`plan_oracle_prefetches`): every true expert of the target layers in order of next use
  (a read ahead enters the cache only when used, so it displaces nothing a demand read would not).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from fate_edge.runtime.policy import DEFAULT_TAIL_MASS, PolicyConfig

Key = tuple[int, int]


@dataclass(frozen=True)
class Prefetch:
    distance: int  # 0: the next MoE layer
    layer: int  # target MoE layer
    expert: int
    cold: bool  # travels in the policy's cold precision (prefill tail)


def prefetch_width(policy: PolicyConfig, k: int, layer_s: float, read_s: float) -> int:
    """Experts to prefetch per target layer before the gate. Fate's rule needs one layer's compute time
    ``layer_s`` and one read's time ``read_s``; until both are known it prefetches ``k`` (top-k)."""
    p = policy
    if isinstance(p.prefetch_width, int):
        return p.prefetch_width
    if p.prefetch_width == "fate":
        if layer_s > 0 and read_s > 0:
            return max(p.min_prefetch_width, min(p.max_prefetch_width, int(layer_s / read_s)))
        return k
    return p.max_prefetch_width  # "mass": the mass rule stops earlier


def ranked(probs: torch.Tensor) -> list[int]:
    """Expert ids by descending score [E], without those scored 0 or less (or NaN)."""
    scores, order = probs.sort(descending=True)  # one operator; a boolean index would add a nonzero and a gather
    return [e for e, s in zip(order.tolist(), scores.tolist()) if s > 0]


def gate_candidates(ranks: list[int], n: int, cached: Callable[[int], bool]) -> dict[int, int]:
    """Rank → expert for the first ``n`` ranks not cached when predicted: the prefetch gate's evidence."""
    return {r: e for r, e in enumerate(ranks[:n]) if not cached(e)}


def cold_tail(popularity: dict[int, int], mass: float) -> set[int]:
    """Fate's prefill tail: the least popular experts, up to ``mass`` of all assignments."""
    total = sum(popularity.values())
    cold, acc = set(), 0
    for e, c in sorted(popularity.items(), key=lambda kv: (kv[1], kv[0])):
        if acc + c > mass * total:
            break
        acc += c
        cold.add(e)
    return cold


def choose(
    policy: PolicyConfig, scores: torch.Tensor, k: int, width: int, use_cold: bool = False
) -> list[tuple[int, float, bool]]:
    """(expert, score, cold) worth prefetching for one target layer, from its scores [N, E]."""
    if scores.shape[0] == 1:  # decode: most probable experts up to the width (or the mass)
        probs = scores[0]
        top = ranked(probs)[:width]
        chosen = top
        if policy.prefetch_width == "mass":
            mass = probs / probs.sum()
            acc, chosen = 0.0, []
            for e in top:
                chosen.append(e)
                acc += float(mass[e])
                if acc >= policy.prefetch_mass and len(chosen) >= k:
                    break
        return [(e, float(probs[e]), False) for e in chosen]
    # prefill: union of every token's predicted top-k, ranked by popularity
    ids, counts = scores.topk(k, dim=-1).indices.flatten().unique(return_counts=True)
    popularity = dict(zip(ids.tolist(), counts.tolist()))
    tail = DEFAULT_TAIL_MASS if policy.cold_tail_mass is None else policy.cold_tail_mass  # None: not resolved
    cold = cold_tail(popularity, tail) if use_cold else set()
    return [(e, float(c), e in cold) for e, c in sorted(popularity.items(), key=lambda kv: -kv[1])]


def plan_prefetches(
    policy: PolicyConfig,
    targets: Sequence[tuple[int, torch.Tensor]],
    k: int,
    width: int,
    busy: Callable[[Key], bool],
    room: int | None = None,
    use_cold: bool = False,
) -> list[Prefetch]:
    """The reads to issue, in order. ``targets``: (target layer, scores [N, E]), nearest first; ``busy(key)``:
    cached or already in flight (never read twice); ``room``: how many more reads may be in flight. The oracle
    policy reads by its own rule (:func:`plan_oracle_prefetches`)."""
    if policy.predictor == "oracle":
        return plan_oracle_prefetches(targets, busy, room)
    plan = []
    for d, (target, scores) in enumerate(targets):
        for e, score, cold in choose(policy, scores, k, width, use_cold):
            plan.append((d, -score, target, e, cold))
    out: list[Prefetch] = []
    for d, _, target, e, cold in sorted(plan):
        if room is not None and len(out) >= room:
            break
        if not busy((target, e)):
            out.append(Prefetch(d, target, e, cold))
    return out


def plan_ranked(target: int, ranks: list[int], width: int, busy: Callable[[Key], bool], room: int) -> list[Prefetch]:
    """:func:`plan_prefetches` for one decode row and one target layer from its experts already ranked (most
    probable first): the same choice, the first ``width`` ranks, those not busy, at most ``room``."""
    out: list[Prefetch] = []
    for e in ranks[:width]:
        if len(out) >= room:
            break
        if not busy((target, e)):
            out.append(Prefetch(0, target, e, False))
    return out


def plan_oracle_prefetches(
    targets: Sequence[tuple[int, torch.Tensor]], busy: Callable[[Key], bool], room: int | None
) -> list[Prefetch]:
    """The oracle's reads (the clairvoyant bound; no width, no cold tail): every true expert of the target
    layers in order of next use (nearest layer first; within a layer, most used first), skipping what is
    cached or in flight; ``room``: as above. No read ahead can cost a hit: it waits in its read buffer and
    enters the cache only when used, where Belady-MIN picks the victim exactly as for a demand miss."""
    out: list[Prefetch] = []
    for d, (target, scores) in enumerate(targets):
        for e in ranked(scores.clamp(min=0).sum(0)):  # [N, E] → the call's experts, summed over its tokens
            if room is not None and len(out) >= room:
                return out
            if not busy((target, e)):
                out.append(Prefetch(d, target, e, False))
    return out


def room_ahead(max_inflight: int, pending: Iterable[Key], layer: int) -> int:
    """How many more reads ahead may start when ``layer`` predicts: its own reads (``pending`` holds reads in
    flight and planned) are consumed next, so only the ones for other layers hold room."""
    return max_inflight - sum(1 for key in pending if key[0] != layer)
