"""The planner: pick a policy for a device and a memory budget (``fate-edge plan``, ``plan="auto"``).

A cost model in the spirit of MoE-Lightning's hierarchical roofline (ASPLOS'25) gives the per-layer
decode compute time (measured on this host, or from a device profile's peaks) and the link model
gives each expert read's time; a trace-driven simulation (:mod:`fate_edge.simulate`, the real cache
classes over recorded routing and predictor outputs) then scores candidate policies. The search is
a coordinate descent from the fate-edge preset over allocation, eviction, predictor, lookahead and
prefetch width.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from devices.link import LinkSpec

from .engine import plan_budget
from .policy import PRESETS, PolicyConfig
from .simulate import SimResult, simulate


@dataclass
class PlanTrace:
    """Routing of N decode tokens and each predictor's scores, recorded once, simulated many times."""

    expert_ids: dict[int, torch.Tensor]  # MoE layer → [N, k]
    predictions: dict[str, dict[tuple[int, int], torch.Tensor]] = field(default_factory=dict)
    num_experts: int = 0
    num_layers: int = 0


def record_plan_trace(model, token_ids: list[int], lookahead: int = 3) -> PlanTrace:
    """Run ``model`` over ``token_ids`` once (teacher-forced: the routing decode would see) and record
    the true experts plus the cross-layer gate predictions (raw and norm variants) up to ``lookahead``."""
    from predictors.cross_layer_gate import CrossLayerGate
    from predictors.evaluate import TraceRecorder

    rec = TraceRecorder(model.config.num_experts)
    model.observers.insert(0, rec)
    try:
        with torch.inference_mode():
            model(torch.tensor([token_ids]), model.new_cache())
    finally:
        model.observers.remove(rec)
    trace = rec.trace()
    out = PlanTrace(trace.expert_ids, {}, model.config.num_experts, model.config.num_hidden_layers)
    for name, norm in (("cross-layer", False), ("cross-layer-norm", True)):
        gate = CrossLayerGate.from_model(model, lookahead=lookahead, norm_variant=norm)
        preds: dict[tuple[int, int], torch.Tensor] = {}
        for src in trace.layers:
            p = gate.predict(src, trace.gate_inputs[src])
            for target in p.layers:
                preds[(src, target)] = p.for_layer(target)
        out.predictions[name] = preds
    return out


def measure_layer_time(model, tokens: int = 16) -> float:
    """Seconds of decode compute per decoder layer on this host (experts as the model's provider holds them)."""
    cache = model.new_cache()
    with torch.inference_mode():
        tok = model(torch.tensor([[1, 2, 3, 4]]), cache, last_only=True)[0, -1].argmax().view(1, 1)
        t0 = time.perf_counter()
        for _ in range(tokens):
            tok = model(tok, cache)[0, -1].argmax().view(1, 1)
    return (time.perf_counter() - t0) / tokens / model.config.num_hidden_layers


def roofline_layer_time(cfg, profile, expert_bytes: int, resident_layer_bytes: int) -> float:
    """Per-layer decode time from a profile's peaks: max(FLOPs / peak, bytes / DRAM bandwidth)."""
    flops = 2 * (resident_layer_bytes / 2 + cfg.num_experts_per_tok * cfg.expert_params)
    read = resident_layer_bytes + cfg.num_experts_per_tok * expert_bytes
    peak = (profile.gpu_tflops_fp32 * 1e12) if profile.gpu_tflops_fp32 else profile.cpu_gflops_fp32 * 1e9
    return max(flops / peak, read / (profile.memory_bandwidth_gbps * 1e9))


@dataclass
class Candidate:
    policy: PolicyConfig
    result: SimResult


@dataclass
class Plan:
    policy: PolicyConfig
    predicted_tokens_per_s: float
    predicted_hit_rate: float
    layer_compute_s: float
    link: LinkSpec
    candidates: list[Candidate]

    def describe(self) -> str:
        p = self.policy
        lines = [
            f"link            {self.link.name}: {self.link.bandwidth_bytes_per_s / 1e9:.2f} GB/s, "
            f"{self.link.latency_s * 1e6:.0f} us",
            f"layer compute   {self.layer_compute_s * 1e3:.3f} ms per decoder layer per token",
            f"chosen policy   allocation={p.allocation} eviction={p.eviction} predictor={p.predictor} "
            f"lookahead={p.lookahead} width={p.prefetch_width}"
            + (f" (mass {p.prefetch_mass})" if p.prefetch_width == "mass" else "") + f" bits={p.bits}",
            f"predicted       {self.predicted_tokens_per_s:.1f} decode tok/s, "
            f"hit rate {100 * self.predicted_hit_rate:.1f}%",
            "",
            "candidates (simulated decode tok/s, hit rate):",
        ]
        for c in sorted(self.candidates, key=lambda c: -c.result.tokens_per_s)[:10]:
            q = c.policy
            width = f"mass{q.prefetch_mass}" if q.prefetch_width == "mass" else q.prefetch_width
            lines.append(f"  {c.result.tokens_per_s:8.1f} tok/s  {100 * c.result.hit_rate:5.1f}%  {q.allocation}/"
                         f"{q.eviction}/{q.predictor}/p={q.lookahead}/w={width}")
        return "\n".join(lines)


def _neighbours(p: PolicyConfig) -> list[PolicyConfig]:
    out = [p.with_(allocation=a) for a in ("uniform", "shallow")]
    out += [p.with_(eviction=e) for e in ("lru", "lfu", "arc", "lcu", "popularity")]
    out += [p.with_(predictor=q) for q in ("cross-layer", "cross-layer-norm")]
    out += [p.with_(lookahead=a) for a in (1, 2, 3)]
    out += [p.with_(prefetch_width=w) for w in ("fate", "mass", 2, 4)]
    out += [p.with_(prefetch_width="mass", prefetch_mass=m) for m in (0.8, 0.95)]
    return out


def plan(trace: PlanTrace, budget: int, expert_bytes: int, slot_bytes: int, link: LinkSpec,
         layer_compute_s: float, start: PolicyConfig | None = None, rounds: int = 2) -> Plan:
    """Coordinate descent over policy settings, scored by simulated decode tokens/s."""
    seen: dict[PolicyConfig, SimResult] = {}

    def score(p: PolicyConfig) -> float:
        if p not in seen:
            cache_bytes = plan_budget(budget, p, expert_bytes, slot_bytes).cache_bytes
            preds = trace.predictions.get(p.predictor) if p.predictor else None
            seen[p] = simulate(trace.expert_ids, preds, p, cache_bytes, expert_bytes, link, layer_compute_s,
                               trace.num_experts, trace.num_layers)
        return seen[p].tokens_per_s

    best = (start or PRESETS["fate-edge"]).with_(name="planned", cold_bits=None)
    for _ in range(rounds):
        improved = False
        for cand in _neighbours(best):
            if score(cand) > score(best) * 1.001:
                best, improved = cand, True
        if not improved:
            break
    return Plan(best, seen[best].tokens_per_s, seen[best].hit_rate, layer_compute_s, link,
                [Candidate(p, r) for p, r in seen.items()])


def sample_token_ids(tokenizer, n: int = 256) -> list[int]:
    """Calibration text that exists offline everywhere: a Python standard-library module's source."""
    import json as _json_module

    text = open(_json_module.decoder.__file__, encoding="utf-8").read()
    return tokenizer.encode(text)[:n]


def auto_plan(store_dir, budget: int, link: LinkSpec | None = None, token_ids: list[int] | None = None,
              dtype: torch.dtype = torch.float32) -> Plan:
    """Plan for this host: record routing on sample text, measure compute, simulate candidates.

    Without ``link`` the expert reads are modelled at the bandwidth measured while recording."""
    from .loader import load_model
    from .store import ExpertStore
    from .tokenizer import Tokenizer

    model = load_model(store_dir, dtype=dtype)  # experts read on demand through the fetch engine
    ids = token_ids or sample_token_ids(Tokenizer(store_dir))
    trace = record_plan_trace(model, ids)
    provider = model.experts
    tokens = 8
    cache = model.new_cache()
    with torch.inference_mode():
        tok = model(torch.tensor([ids[:8]]), cache, last_only=True)[0, -1].argmax().view(1, 1)
        t0 = time.perf_counter()
        s0 = provider.stats.stall_s
        for _ in range(tokens):
            tok = model(tok, cache)[0, -1].argmax().view(1, 1)
    elapsed = time.perf_counter() - t0
    io_s = provider.stats.stall_s - s0
    layer_s = max(1e-6, (elapsed - io_s) / tokens / model.config.num_hidden_layers)
    store = ExpertStore(store_dir)
    bits = provider.bits
    if link is None:
        bw = provider.stats.bytes_read / max(provider.stats.stall_s, 1e-9)
        link = LinkSpec("this host's disk (measured)", bw, 0.0)
    provider.close()
    return plan(trace, budget, store.expert_bytes(bits), store.precisions[bits].slot_bytes, link, layer_s)
