"""The bound as the best of the oracle's own configurations, in the simulator.

The ``oracle`` preset reads the true experts ahead with up to 64 read buffers, and those buffers come out of the
budget: on a link where every read ahead arrives late, Belady's cache alone (no reads ahead, the whole budget
cached) decodes faster (on the emulated Orin Nano at 35% and 50%, 128 tokens: 539 vs 518 and 1041 vs 925
device-eq. tok/s). The bound is therefore the fastest of the clairvoyant configurations: Belady eviction with
the true experts read ahead at each of :data:`ORACLE_WIDTHS` (0: none). The engine runs one of them (the
preset's); this says how far the best one would go on a recorded trace."""

from __future__ import annotations

from dataclasses import replace

import torch
from fate_edge.devices.link import LinkSpec

from fate_edge.planning.simulate import HostCosts, SimResult, simulate
from fate_edge.runtime.budget import plan_budget
from fate_edge.runtime.policy import PRESETS

ORACLE_WIDTHS = (0, 1, 2, 4, 8, 64)  # read-ahead widths tried; 0 = Belady's cache alone


def oracle_bound(
    expert_ids: dict[int, torch.Tensor],
    oracle_scores: dict[tuple[int, int], torch.Tensor],
    budget: int,
    entry_bytes: int,
    slot_bytes: int,
    link: LinkSpec,
    costs: HostCosts | float,
    num_experts: int,
    num_layers: int,
    warm: dict[int, list[int]] | None = None,
    popularity: dict[int, list[int]] | None = None,
) -> tuple[int, SimResult]:
    """(width, result) of the fastest clairvoyant configuration under ``budget`` on this trace; ``oracle_scores``
    as the oracle predictor scores (``_replay.oracle_scores`` in the tests, the recorded trace in a bench)."""
    best: tuple[int, SimResult] | None = None
    for width in ORACLE_WIDTHS:
        policy = replace(PRESETS["oracle"], prefetch_width=width)
        plan = plan_budget(budget, policy, entry_bytes, slot_bytes)
        r = simulate(
            expert_ids,
            oracle_scores if width else None,
            policy,
            plan.cache_bytes,
            entry_bytes,
            link,
            costs,
            num_experts,
            num_layers,
            warm=warm,
            max_inflight=max(plan.pool_buffers - 2, 0),
            popularity=popularity,
        )
        if best is None or r.total_s < best[1].total_s:
            best = (width, r)
    assert best is not None
    return best
