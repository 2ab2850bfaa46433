"""The planner: pick a policy for a device and a memory budget (``fate-edge plan``, ``policy="auto"``).

A cost model in the spirit of MoE-Lightning's hierarchical roofline (ASPLOS'25): per-layer decode
compute (measured on this host, or from a device profile's peaks), each expert read's link time from
the link model, and on this host what a read costs its CPU (the reader thread's time, and decoding
the blob), measured by two short probe runs of the engine itself. A trace-driven simulation
(:mod:`fate_edge.planning.simulate`, the real cache classes over recorded routing and predictor outputs) then
scores candidate policies. The search is a coordinate descent from the fate-edge preset over
allocation, eviction, predictor, lookahead and prefetch width.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from fate_edge.devices.link import LinkSpec
from fate_edge.planning.host_costs import measure_host_costs
from fate_edge.planning.miss_placement import MissCosts, miss_compute_for
from fate_edge.planning.plan_presets import MIN_MARGIN, choose, preset_candidates
from fate_edge.planning.plan_trace import PlanTrace, describe_store, record_plan_trace, sample_token_ids
from fate_edge.planning.sim_load import sim_preload, sim_resident
from fate_edge.planning.simulate import HostCosts, SimResult, simulate
from fate_edge.runtime.budget import plan_budget
from fate_edge.runtime.policy import PRESETS, PolicyConfig


@dataclass
class Candidate:
    policy: PolicyConfig
    result: SimResult


@dataclass
class Plan:
    policy: PolicyConfig
    predicted_tokens_per_s: float
    predicted_hit_rate: float
    link: LinkSpec
    candidates: list[Candidate]
    costs: HostCosts
    presets: list[Candidate] = field(default_factory=list)  # always simulated; the pick is one unless beaten
    margin: float = 0.0  # what a searched policy had to beat the best preset by (the planner's measured error)
    # the measured costs of a miss each way (miss_placement.MissCosts), where the device has a host link: they seed
    # the run's per-miss choice under miss_compute="hybrid" (runtime.miss_rule)
    miss_costs: MissCosts | None = None

    def describe(self) -> str:
        p = self.policy
        lines = [
            f"link            {self.link.name}: {self.link.bandwidth_bytes_per_s / 1e9:.2f} GB/s, "
            f"{self.link.latency_s * 1e6:.0f} us",
            f"layer compute   {self.costs.layer_compute_s * 1e3:.3f} ms per MoE layer per token",
            f"host costs      {self.costs.describe()}",
            f"chosen policy   allocation={p.allocation} eviction={p.eviction} predictor={p.predictor} "
            f"lookahead={p.lookahead} width={p.prefetch_width}"
            + (f" (mass {p.prefetch_mass})" if p.prefetch_width == "mass" else "")
            + f" bits={p.bits}",
            f"predicted       {self.predicted_tokens_per_s:.1f} decode tok/s, "
            f"hit rate {100 * self.predicted_hit_rate:.1f}%",
            *(f"preset          {c.policy.name}: {c.result.tokens_per_s:.1f} tok/s predicted" for c in self.presets),
            f"margin          a searched policy replaces the best preset when predicted {100 * self.margin:.0f}% "
            "faster (the planner's error on its probe, at least 3%)",
            "",
            "candidates (simulated decode tok/s, hit rate):",
        ]
        for c in sorted(self.candidates, key=lambda c: -c.result.tokens_per_s)[:10]:
            q = c.policy
            width = f"mass{q.prefetch_mass}" if q.prefetch_width == "mass" else q.prefetch_width
            lines.append(
                f"  {c.result.tokens_per_s:8.1f} tok/s  {100 * c.result.hit_rate:5.1f}%  {q.allocation}/"
                f"{q.eviction}/{q.predictor}/p={q.lookahead}/w={width}"
            )
        return "\n".join(lines)


def _neighbours(p: PolicyConfig) -> list[PolicyConfig]:
    out = [p.with_(allocation=a) for a in ("uniform", "shallow", "global")]  # global: the link-bound devices' pick
    out += [p.with_(eviction=e) for e in ("lru", "lfu", "arc", "lcu", "popularity")]
    out += [p.with_(predictor=q) for q in ("best-available", "cross-layer", "cross-layer-norm", None)]
    out += [p.with_(lookahead=a) for a in (1, 2, 3)]
    out += [p.with_(prefetch_width=w) for w in ("fate", "mass", 2, 4)]
    out += [p.with_(prefetch_width="mass", prefetch_mass=m) for m in (0.8, 0.95)]
    out += [p.with_(prefetch_gate=g) for g in (True, False)]
    return out


def simulate_policy(
    trace: PlanTrace,
    policy: PolicyConfig,
    budget: int,
    expert_bytes: int,
    slot_bytes: int,
    link: LinkSpec,
    costs: HostCosts,
) -> SimResult:
    """``policy`` under ``budget`` simulated over ``trace``: its cache gets what the engine's budget plan leaves,
    seeded with the store's calibration counts and filled at load as the engine fills it (sim_load.py)."""
    cache_bytes = plan_budget(budget, policy, expert_bytes, slot_bytes).cache_bytes
    preds = trace.predictions.get(policy.predictor) if policy.predictor else None
    layers = sorted(trace.expert_ids)
    resident = sim_resident(
        policy, layers, trace.num_experts, cache_bytes, {policy.bits: expert_bytes, **trace.entry_bytes}
    )
    fill = sim_preload(policy, layers, trace.num_experts, cache_bytes, expert_bytes, trace.popularity, resident)
    return simulate(
        trace.expert_ids,
        preds,
        policy,
        cache_bytes,
        expert_bytes,
        link,
        costs,
        trace.num_experts,
        trace.num_layers,
        warm=trace.warm,
        popularity=trace.popularity,
        resident=resident,
        preload=fill,
    )


def probe_error(
    trace: PlanTrace, budget: int, expert_bytes: int, slot_bytes: int, link: LinkSpec, costs: HostCosts
) -> float:
    """The simulator's relative error on the run it was measured from: the LRU probe (``trace`` is its decode)
    simulated with the costs measured on it, against its measured decode speed; 0 when not measured."""
    if not trace.probe_tokens_per_s:
        return 0.0
    sim = simulate_policy(trace, PRESETS["lru"], budget, expert_bytes, slot_bytes, link, costs)
    return abs(sim.tokens_per_s / trace.probe_tokens_per_s - 1)


def plan(
    trace: PlanTrace,
    budget: int,
    expert_bytes: int,
    slot_bytes: int,
    link: LinkSpec,
    layer_compute_s: float | HostCosts,
    start: PolicyConfig | None = None,
    rounds: int = 2,
    presets: Sequence[PolicyConfig] = (),
    margin: float = 0.0,
) -> Plan:
    """Coordinate descent over policy settings, scored by simulated decode tokens/s. ``layer_compute_s``:
    the measured :class:`HostCosts`, or just per-layer compute seconds (a device profile's roofline).
    ``presets`` are simulated too, and the best of them is the pick unless the search's best is predicted faster
    by more than ``margin`` (plan_presets.choose)."""
    costs = layer_compute_s if isinstance(layer_compute_s, HostCosts) else HostCosts(layer_compute_s)
    seen: dict[PolicyConfig, SimResult] = {}

    def score(p: PolicyConfig) -> float:
        if p not in seen:
            seen[p] = simulate_policy(trace, p, budget, expert_bytes, slot_bytes, link, costs)
        return seen[p].tokens_per_s

    best = (start or PRESETS["fate-edge"]).with_(name="planned", cold_bits=None)
    for _ in range(rounds):
        improved = False
        for cand in _neighbours(best):
            if score(cand) > score(best) * 1.001:
                best, improved = cand, True
        if not improved:
            break
    for p in presets:
        score(p)
    pick = choose(best, presets, score, margin)
    return Plan(
        pick,
        seen[pick].tokens_per_s,
        seen[pick].hit_rate,
        link,
        [Candidate(p, r) for p, r in seen.items()],
        costs,
        [Candidate(p, seen[p]) for p in presets],
        max(margin, MIN_MARGIN) if presets else 0.0,
    )


def predict_on(
    result: Plan, trace: PlanTrace, budget: int, expert_bytes: int, slot_bytes: int, policy: PolicyConfig | None = None
) -> float | None:
    """``policy`` (default: the plan's pick) simulated with the plan's costs and link over another routing (a
    benchmark's own prompt): the time model's prediction for that request, apart from how well the planner's probe
    text stands for it. None for a policy that needs predictor scores (the trace has none)."""
    policy = policy or result.policy
    if policy.predictor is not None and policy.predictor not in trace.predictions:
        return None
    return simulate_policy(trace, policy, budget, expert_bytes, slot_bytes, result.link, result.costs).tokens_per_s


def auto_plan(
    store_dir,
    budget: int,
    link: LinkSpec | None = None,
    token_ids: list[int] | None = None,
    dtype: torch.dtype = torch.float32,
    prompt_tokens: int = 64,
    decode_tokens: int = 128,
    workers: int = 2,
    progress: Callable[[str], None] | None = None,
    direct_io: bool | None = None,
    resident_bits: int | None = None,
    device: str | None = None,
) -> Plan:
    """Plan for this host: probe the engine under ``budget`` on sample text (the prompt's first
    ``prompt_tokens`` tokens, then ``decode_tokens`` greedy tokens) to measure the host's costs and record
    the decode's routing, then simulate candidates over that trace. ``resident_bits``: the probe holds the resident
    linears quantized so (8 or 4), as the runs being planned do. ``device``: the device being run or emulated
    (a short or profile name), whose ``fate-edge`` row is among the presets always weighed (plan_presets.py) and
    where the search starts; None: this host's preset.

    Without ``link`` the expert reads are modelled at the disk bandwidth the probes measured. ``progress``
    receives a line before each probe and before the simulation."""
    from fate_edge.fetch.store_provider import StoreExpertProvider
    from fate_edge.format.store import ExpertStore
    from fate_edge.model.arch import load_config
    from fate_edge.runtime.loader import load_model
    from fate_edge.tokenizer import Tokenizer

    ids = token_ids or sample_token_ids(Tokenizer(store_dir))
    presets = preset_candidates(device, store_dir, resident_bits)
    costs, link, trace = measure_host_costs(
        store_dir,
        budget,
        link,
        ids[:prompt_tokens],
        dtype,
        workers=workers,
        decode_tokens=decode_tokens,
        progress=progress,
        direct_io=direct_io,
        resident_bits=resident_bits,
        preset=presets[0],
    )
    store = ExpertStore(store_dir)
    bits = PRESETS["fate-edge"].bits
    if trace is None:  # nothing decoded (cannot happen with decode_tokens >= 1): fall back to teacher forcing
        model = load_model(store_dir, dtype=dtype)
        experts = model.experts
        assert isinstance(experts, StoreExpertProvider)  # a store's experts stream through the fetch engine
        try:
            trace = record_plan_trace(model, ids, store_dir=store_dir)
        finally:
            experts.close()
    describe_store(trace, store)
    expert, slot = store.expert_bytes(bits), store.precisions[bits].slot_bytes
    margin = probe_error(trace, budget, expert, slot, link, costs)
    if progress:
        progress(
            f"simulating candidate policies over the recorded routing (simulator off by {100 * margin:.1f}% "
            "on the probe)"
        )
    result = plan(trace, budget, expert, slot, link, costs, start=presets[0], presets=presets, margin=margin)
    return with_miss_compute(result, device, expert, 4 * load_config(store_dir).hidden_size)


def with_miss_compute(result: Plan, device: str | None, expert_bytes: int, hidden_bytes: int) -> Plan:
    """The plan's policy with ``miss_compute="hybrid"`` where ``device`` is a discrete GPU whose link makes a miss
    cheaper on the CPU at the probe's measured per-expert time (planning/miss_placement.py); else unchanged."""
    from fate_edge.devices.profile import load_profile
    from fate_edge.planning.device_presets import profile_of

    if device is None or result.costs.expert_s <= 0:
        return result
    try:
        profile = load_profile(profile_of(device))
    except (OSError, ValueError):  # a device without a profile: nothing says it has a link
        return result
    choice = miss_compute_for(profile, expert_bytes, hidden_bytes, result.costs.expert_s)
    if profile.host_link_gbps is not None and not profile.unified_memory:
        costs = MissCosts(expert_bytes, hidden_bytes, profile.host_link_gbps * 1e9, result.costs.expert_s)
        result = replace(result, miss_costs=costs)
    if choice == result.policy.miss_compute:
        return result
    return replace(result, policy=result.policy.with_(miss_compute=choice))
