"""The planner: pick a policy for a device and a memory budget (``fate-edge plan``, ``plan="auto"``).

A cost model in the spirit of MoE-Lightning's hierarchical roofline (ASPLOS'25): per-layer decode
compute (measured on this host, or from a device profile's peaks), each expert read's link time from
the link model, and on this host what a read costs its CPU (the reader thread's time, and decoding
the blob), measured by two short probe runs of the engine itself. A trace-driven simulation
(:mod:`fate_edge.planning.simulate`, the real cache classes over recorded routing and predictor outputs) then
scores candidate policies. The search is a coordinate descent from the fate-edge preset over
allocation, eviction, predictor, lookahead and prefetch width.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from fate_edge import defaults
from fate_edge.devices.detect import reader_contention
from fate_edge.devices.emulate import device_roofline
from fate_edge.devices.link import LinkSpec
from fate_edge.planning.plan_presets import MIN_MARGIN, choose, preset_candidates
from fate_edge.planning.sim_load import sim_preload, sim_resident
from fate_edge.planning.simulate import HostCosts, SimResult, simulate
from fate_edge.runtime.budget import plan_budget
from fate_edge.runtime.policy import PRESETS, PolicyConfig


@dataclass
class PlanTrace:
    """Routing of N decode tokens and each predictor's scores, recorded once, simulated many times."""

    expert_ids: dict[int, torch.Tensor]  # MoE layer → [N, k]
    predictions: dict[str, dict[tuple[int, int], torch.Tensor]] = field(default_factory=dict)
    num_experts: int = 0
    num_layers: int = 0
    warm: dict[int, list[int]] | None = None  # the prompt's experts per layer (prefill loads them first)
    popularity: dict[int, list[int]] | None = None  # the store's calibration counts (Engine.popularity)
    entry_bytes: dict[int, int] = field(default_factory=dict)  # bits → one expert's bytes (Fate's resident layer)
    probe_tokens_per_s: float | None = None  # the LRU probe's measured decode speed (the planner's own error)


def record_plan_trace(
    model, token_ids: list[int], lookahead: int = 3, store_dir: str | Path | None = None
) -> PlanTrace:
    """Run ``model`` over ``token_ids`` once (teacher-forced) and record the true experts plus the
    predictors' scores (see :func:`trace_predictions`). For a device profile, where the engine cannot be
    probed; on this host :func:`auto_plan` records the engine's own decode instead."""
    from fate_edge.predictors.evaluate import collect_traces

    with torch.inference_mode():
        trace = collect_traces(model, [torch.tensor([token_ids])], early=reads_early_attention(store_dir))
    return trace_predictions(model, trace.expert_ids, trace.gate_inputs, lookahead, store_dir, trace.early_inputs)


def reads_early_attention(store_dir: str | Path | None) -> bool:
    """Whether the learned predictor best-available runs from ``store_dir`` reads the early attention's estimate
    (``fate-edge calibrate --early-attention``): a trace for it must record that estimate too."""
    from fate_edge.predictors.learned import find_learned, read_manifest

    path = find_learned(Path(store_dir) / "predictors", widest=True) if store_dir is not None else None
    return path is not None and bool(read_manifest(path).get("early_attention", False))


def trace_predictions(
    model,
    expert_ids: dict[int, torch.Tensor],
    gate_inputs: dict[int, torch.Tensor],
    lookahead: int = 3,
    store_dir: str | Path | None = None,
    early: dict[int, torch.Tensor] | None = None,
) -> PlanTrace:
    """Score every recorded gate input with each predictor the engine can run: the cross-layer gate (raw
    and norm variants) up to ``lookahead`` layers ahead, and the learned predictor (``fate-edge
    calibrate``) when ``store_dir`` has one, which is what ``best-available`` runs (``early``: the early
    attention's estimates for the same rows, which a predictor calibrated with ``--early-attention`` reads)."""
    from fate_edge.predictors.cross_layer_gate import CrossLayerGate
    from fate_edge.predictors.learned import LearnedPredictor, find_learned
    from fate_edge.predictors.previous_input import widen_inputs

    out = PlanTrace(expert_ids, {}, model.config.num_experts, model.config.num_hidden_layers)
    layers = sorted(expert_ids)
    predictors: dict[str, object] = {
        "cross-layer": CrossLayerGate.from_model(model, lookahead=lookahead, norm_variant=False),
        "cross-layer-norm": CrossLayerGate.from_model(model, lookahead=lookahead, norm_variant=True),
    }
    path = find_learned(Path(store_dir) / "predictors", widest=True) if store_dir is not None else None
    learned = LearnedPredictor.load(path) if path is not None else None  # what best-available runs, widest
    if learned is not None:
        predictors["learned"] = learned
    # A learned predictor reading the previous token's inputs reads them from the rows above (consecutive tokens).
    widened = {}
    if learned is not None and learned.early_attention and early is None:
        raise ValueError(
            "the learned predictor reads the early attention's estimate; the trace has none "
            "(record it with collect_traces(..., early=True))"
        )
    if learned is not None and (learned.context is not None or learned.early_attention) and gate_inputs:
        widened = widen_inputs(
            gate_inputs,
            layers,
            len(next(iter(gate_inputs.values()))),
            previous=learned.context is not None,
            early=early if learned.early_attention else None,
        )
    for name, predictor in predictors.items():
        preds: dict[tuple[int, int], torch.Tensor] = {}
        with torch.inference_mode():
            for src in layers:
                p = predictor.predict(
                    src, widened.get(src, gate_inputs[src]) if predictor is learned else gate_inputs[src]
                )
                for target in p.layers:
                    preds[(src, target)] = p.for_layer(target)
        out.predictions[name] = preds
    out.predictions["best-available"] = out.predictions["learned" if learned is not None else "cross-layer-norm"]
    return out


@dataclass
class ProbeRun:
    tokens: int  # decode tokens measured
    compute_s: float  # the median token's compute (time less stall and blob decoding) x tokens
    stall_s: float
    consume_s: float
    predict_s: float
    reads: int  # reads completed by the fetch engine during decode (used or not)
    reader_cpu_s: float
    read_s: float
    bytes_read: int
    trace: PlanTrace | None = None  # the decode's routing and predictor scores (record=True)
    decode_s: float = 0.0  # wall time from the first streamed token to the last (``tokens`` decode steps)
    expert_s: float = 0.0  # the caller's compute per cached expert use (SchedulerStats.expert_s), median token's
    compute_sum_s: float = 0.0  # every token's compute summed (hiccups of the host included)


class _DecodeRecorder:
    """Routing observer: each decode step's gate inputs and experts, and the prompt's experts per layer (with
    ``early``, an early_attention.EarlyInput, also each step's early-attention estimate)."""

    def __init__(self, early=None) -> None:
        self.h: dict[int, list[torch.Tensor]] = {}
        self.ids: dict[int, list[torch.Tensor]] = {}
        self.warm: dict[int, list[int]] = {}
        self.early_attention = early
        self.early: dict[int, list[torch.Tensor]] = {}

    def __call__(self, layer: int, h: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> None:
        if h.shape[0] > 1:  # prefill: the union, most popular first, as the engine loads it
            ids, counts = idx.flatten().unique(return_counts=True)
            self.warm[layer] = ids[counts.argsort(descending=True, stable=True)].tolist()
            return
        self.h.setdefault(layer, []).append(h.detach().float().clone())
        self.ids.setdefault(layer, []).append(idx.detach().clone())
        if self.early_attention is not None and layer in self.early_attention.next:
            self.early.setdefault(layer, []).append(self.early_attention.estimate(layer, h))


def token_compute_s(times: list[float], token_stats: list) -> list[float]:
    """Each decode token's compute: the time between consecutive ``times`` (one per streamed token) less its stall
    and blob decoding (``token_stats``, the engine's per-token stats, in order)."""
    return [dt - s.stall_s - s.consume_s for dt, s in zip(np.diff(times), token_stats)]


def expert_compute_s(token_stats: list) -> float:
    """One cached expert's compute in decode: per token, the time its cached experts took over their number; the
    median over tokens (a hiccup of the host in one token does not skew it); 0 when none was cached."""
    per = [s.expert_s / s.experts_timed for s in token_stats if s.experts_timed]
    return float(np.median(per)) if per else 0.0


def probe_engine(
    store_dir,
    budget: int,
    policy: PolicyConfig,
    link: LinkSpec | None,
    token_ids: list[int],
    dtype: torch.dtype,
    tokens: int = 16,
    workers: int = defaults.FETCH_WORKERS,
    record: bool = False,
    direct_io: bool | None = None,
    resident_bits: int | None = None,
) -> ProbeRun:
    """Decode ``tokens`` greedy tokens after ``token_ids`` with the real engine under ``budget``; the second
    of two runs is measured (the first warms torch's kernels and checks each blob's CRC once, as a
    long-running engine would have). ``record``: also keep the decode's routing as a :class:`PlanTrace`.
    ``direct_io``: O_DIRECT reads (default: only without a link, i.e. from the raw disk). ``resident_bits``: the
    engine's resident linears quantized (8 or 4), as the run being planned holds them."""
    from fate_edge.devices.link import ThrottledLink
    from fate_edge.runtime.engine import Engine
    from fate_edge.runtime.generate import GenerateConfig

    run = None
    for attempt in range(2):
        eng = Engine(
            store_dir,
            budget,
            policy,
            dtype=dtype,
            link=ThrottledLink(link) if link else None,
            workers=workers,
            direct_io=link is None if direct_io is None else direct_io,
            resident_bits=resident_bits,
        )
        rec = None
        if record and attempt == 1:
            from fate_edge.predictors.early_attention import EarlyInput

            rec = _DecodeRecorder(EarlyInput(eng.model) if reads_early_attention(store_dir) else None)
        if rec is not None:
            eng.model.observers.insert(0, rec)
        try:
            times, f0 = [], None
            for _resp in eng.stream(token_ids, GenerateConfig(max_tokens=tokens + 1, ignore_eos=True)):
                times.append(time.perf_counter())
                if f0 is None:  # the first token ends prefill: measure decode from here
                    f0 = dataclasses.replace(eng.fetch.stats)
            f1 = eng.fetch.stats
            st = eng.token_stats
            # Compute per token = its time minus its stall and blob decoding; the median over tokens, so a
            # hiccup of the host (another process, page-cache writeback) does not skew it.
            compute = token_compute_s(times, st)
            run = ProbeRun(
                len(st),
                float(np.median(compute)) * len(st),
                sum(s.stall_s for s in st),
                sum(s.consume_s for s in st),
                sum(s.predict_s for s in st),
                f1.reads_completed - f0.reads_completed,
                f1.cpu_s - f0.cpu_s,
                f1.read_s - f0.read_s,
                f1.bytes_read - f0.bytes_read,
                decode_s=times[-1] - times[0],
                expert_s=expert_compute_s(st),
                compute_sum_s=float(np.sum(compute)),
            )
            if rec is not None and rec.ids:
                ids = {layer: torch.cat(v) for layer, v in rec.ids.items()}
                h = {layer: torch.cat(v) for layer, v in rec.h.items()}
                early = {layer: torch.cat(v) for layer, v in rec.early.items()} if rec.early else None
                run.trace = trace_predictions(eng.model, ids, h, store_dir=store_dir, early=early)
                run.trace.warm = rec.warm
                run.trace.probe_tokens_per_s = (len(times) - 1) / run.decode_s if run.decode_s > 0 else None
        finally:
            eng.close()
            del eng
            gc.collect()  # the next engine starts without this one's objects (a later GC pass would be timed)
    assert run is not None
    return run


def probe_point(run: ProbeRun) -> tuple[float, float]:
    """A probe's (stall, compute) per decode token, mean over its tokens; compute leaves out the predictor's time
    (charged apart, as ``predict_s``)."""
    n = max(1, run.tokens)
    return run.stall_s / n, ((run.compute_sum_s or run.compute_s) - run.predict_s) / n


def stall_drag(points: list[tuple[float, float]], fallback: float) -> tuple[float, float]:
    """Compute per token with no stall, and the extra compute per second of stall, from (stall, compute) per token
    of two probe runs: the line through both. Where their stalls are too close to tell a slope (under 2 ms or 20%
    apart), or compute does not grow with stall, (``fallback``, 0). The slope is capped so that compute with no
    stall is at least half the smaller measured one: two short probes on a shared host give no more evidence."""
    (s1, c1), (s2, c2) = sorted(points)
    if s2 - s1 < max(2e-3, 0.2 * s2) or c2 <= c1:
        return fallback, 0.0
    floor = 0.5 * min(c1, c2)
    slope = min((c2 - c1) / (s2 - s1), (c1 - floor) / s1 if s1 > 0 else float("inf"))
    return c1 - slope * s1, slope


def measure_host_costs(
    store_dir,
    budget: int,
    link: LinkSpec | None,
    token_ids: list[int],
    dtype: torch.dtype = torch.float32,
    predictor_policy: PolicyConfig | None = None,
    workers: int = defaults.FETCH_WORKERS,
    decode_tokens: int = 128,
    progress: Callable[[str], None] | None = None,
    direct_io: bool | None = None,
    predictor_probe: bool = True,
    resident_bits: int | None = None,
    preset: PolicyConfig | None = None,
) -> tuple[HostCosts, LinkSpec, PlanTrace | None]:
    """The simulator's constants for this host and a decode trace, from probe runs of the engine under
    ``budget``: an LRU cache without prediction decoding ``decode_tokens`` tokens after ``token_ids`` (all
    reads are demand reads, so what is not stalling or decoding blobs is compute; its routing is the
    trace); then ``preset`` (the device's preset) for up to 32 tokens, whose stall differs from the LRU probe's: the
    two give compute as a function of stall (:func:`stall_drag`), and a preset with a predictor its cost; then,
    where no predictor cost was measured yet, the predictor's policy for a few tokens (skipped, with no predictor
    cost, when ``predictor_probe`` is False). Without
    ``link`` the disk is read with O_DIRECT and its bandwidth is the one measured. ``progress`` is told
    before each probe. ``resident_bits``: the probes' resident linears quantized (8 or 4)."""
    from fate_edge.model.arch import load_config

    say = progress or (lambda message: None)
    moe_layers = len(load_config(store_dir).moe_layers)
    # The probes this call runs: the LRU one; the preset's; the predictor's, where the preset runs none.
    total = 1 + (preset is not None) + (predictor_probe and (preset is None or preset.predictor is None))
    say(f"probe 1/{total}: {decode_tokens} tokens with an LRU cache and no prediction (compute, reads, routing)")
    base = probe_engine(
        store_dir,
        budget,
        PRESETS["lru"],
        link,
        token_ids,
        dtype,
        tokens=decode_tokens,
        workers=workers,
        record=True,
        direct_io=direct_io,
        resident_bits=resident_bits,
    )
    reads = max(1, base.reads)
    contention = reader_contention(torch.get_num_threads(), workers)
    # The mean token's compute, not the median's: what is predicted is decode tokens over wall time, which the
    # host's hiccups lengthen as much in the planned run as in the probe (a median-based compute predicted
    # every pick faster than measured on a loaded host).
    compute = (base.compute_sum_s or base.compute_s) / max(1, base.tokens) / moe_layers
    predict_s, drag = 0.0, 0.0

    def probe(policy: PolicyConfig, tokens: int) -> ProbeRun:
        return probe_engine(
            store_dir,
            budget,
            policy,
            link,
            token_ids,
            dtype,
            tokens=tokens,
            workers=workers,
            direct_io=direct_io,
            resident_bits=resident_bits,
        )

    if preset is not None:
        # The preset at its own stall level (it caches and prefetches; the LRU probe waits on every miss): compute
        # per token as the line through both runs' (stall, compute) (stall_drag). Ungated, so a predictor runs on
        # every layer call and its cost per call is measured too.
        say(f"probe 2/{total}: {min(32, decode_tokens)} tokens of the preset (compute at its stall level)")
        pre = probe(preset.with_(prefetch_gate=False), min(32, decode_tokens))
        per_token, drag = stall_drag([probe_point(base), probe_point(pre)], compute * moe_layers)
        compute = per_token / moe_layers
        if pre.predict_s > 0:
            predict_s = pre.predict_s / max(1, pre.tokens) / moe_layers
    if predictor_probe and predict_s == 0.0:
        # Ungated, so the predictor runs on every layer call and its cost per call is what is measured.
        say(f"probe {total}/{total}: a few tokens with the predictor on every layer (its cost)")
        pred = probe((predictor_policy or PRESETS["fate-edge"]).with_(prefetch_gate=False), 16)
        predict_s = pred.predict_s / max(1, pred.tokens) / moe_layers
    costs = HostCosts(
        layer_compute_s=max(1e-6, compute),
        predict_s=predict_s,
        read_cpu_s=base.reader_cpu_s / reads if base.reads else 0.0,
        consume_s=base.consume_s / reads if base.reads else 0.0,
        contention=contention,
        expert_s=base.expert_s,
        stall_drag=drag,
    )
    if link is None:
        bw = base.bytes_read / base.read_s if base.read_s > 0 else 1e9
        link = LinkSpec("this host's disk (measured)", bw, 0.0)
    return costs, link, base.trace


def roofline_layer_time(cfg, profile, expert_bytes: int, resident_layer_bytes: int) -> float:
    """Per-layer decode time on a device: its roofline (devices/emulate.py) over the layer's resident weights at
    fp16 and its top-k experts."""
    flops = 2 * (resident_layer_bytes / 2 + cfg.num_experts_per_tok * cfg.expert_params)
    read = resident_layer_bytes + cfg.num_experts_per_tok * expert_bytes
    return device_roofline(profile).time_s(read, flops)


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


def trace_from_calls(
    calls: list[tuple[int, list[int]]], moe_layers: list[int], top_k: int, num_experts: int, num_layers: int
) -> PlanTrace | None:
    """A recorded request's calls (``Engine.record_trace``: per MoE call, its experts) as a :class:`PlanTrace`
    without predictor scores: the decode's routing (the trailing whole tokens of ``top_k`` experts a layer) and the
    prompt's experts per layer as ``warm``. None when no decode token was recorded."""
    n, i = len(moe_layers), len(calls)
    while i >= n and all(len(calls[j][1]) == top_k for j in range(i - n, i)):
        i -= n
    decode = calls[i:]
    if not decode:
        return None
    ids = {layer: torch.tensor([list(e) for lyr, e in decode if lyr == layer]) for layer in moe_layers}
    warm: dict[int, list[int]] = {}
    for layer, experts in calls[:i]:
        warm.setdefault(layer, []).extend(e for e in experts if e not in warm.get(layer, []))
    return PlanTrace(ids, {}, num_experts, num_layers, warm)


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


def sample_token_ids(tokenizer, n: int = 256) -> list[int]:
    """Calibration text that exists offline everywhere: a Python standard-library module's source."""
    import json as _json_module

    text = open(_json_module.decoder.__file__, encoding="utf-8").read()
    return tokenizer.encode(text)[:n]


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
    from fate_edge.format.store import ExpertStore
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
        try:
            trace = record_plan_trace(model, ids, store_dir=store_dir)
        finally:
            model.experts.close()
    describe_store(trace, store)
    expert, slot = store.expert_bytes(bits), store.precisions[bits].slot_bytes
    margin = probe_error(trace, budget, expert, slot, link, costs)
    if progress:
        progress(
            f"simulating candidate policies over the recorded routing (simulator off by {100 * margin:.1f}% "
            "on the probe)"
        )
    return plan(trace, budget, expert, slot, link, costs, start=presets[0], presets=presets, margin=margin)


def describe_store(trace: PlanTrace, store) -> None:
    """What the simulator needs of the store beside routing: calibration counts, and each precision's expert bytes
    (Fate's resident first layer is held at the highest that fits)."""
    from fate_edge.runtime.calibrate import store_popularity

    trace.popularity = store_popularity(store.path)
    trace.entry_bytes = {b: store.expert_bytes(b) for b in store.precisions}
