"""Recorded runs of the bundled store, replayed through the real engine and through the simulator.

Shared by the prefetch-decision tests (the engine and the planner choose alike) and the waste contracts
(counters on a recorded trace at a fixed budget). Everything here counts; nothing is timed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from fate_edge.devices.link import LinkSpec
from fate_edge.predictors.oracle import OraclePredictor

from fate_edge import GenerateConfig
from fate_edge.fetch.fetch_engine import Priority
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.format.store import ExpertStore
from fate_edge.planning.simulate import HostCosts, simulate
from fate_edge.runtime.engine import Engine, Trace
from fate_edge.runtime.engine_config import EngineConfig

PROMPT = "def parse_args(argv):\n    "
CFG = GenerateConfig(max_tokens=16, ignore_eos=True)
LINK = LinkSpec("replay", bandwidth_bytes_per_s=1e9, latency_s=0.0)


def int4_store(out, bundled_dir):
    """The bundled model as an int4 expert store."""
    return convert(bundled_dir, out, ConvertOptions.full(bits=4, keep_bf16=False), progress=False)


def record(store) -> tuple[object, Trace]:
    """``store`` and the routing of PROMPT under CFG on it, recorded once (what the oracle replays)."""
    with Engine(EngineConfig(store, "64MB", "lru")) as rec:
        return store, rec.record_trace(PROMPT, CFG)


def all_expert_bytes(store) -> int:
    s = ExpertStore(store)
    return s.expert_bytes(4) * len(s.index["moe_layers"]) * s.index["num_experts"]


@dataclass
class Submissions:
    """Every read the scheduler asked for: decode prefetches as (step, layer, expert), and the contract
    breaches seen at submission time (a prefetch of an expert already cached or already in flight)."""

    prefetched: list[tuple[int, int, int]] = field(default_factory=list)
    of_cached: list[tuple[int, int]] = field(default_factory=list)
    of_inflight: list[tuple[int, int]] = field(default_factory=list)
    step: int = -1  # -1 during prefill, then the decode step


def spy(engine: Engine) -> Submissions:
    """Wrap ``engine.fetch.submit`` and follow the decode steps with a routing observer; a prefetch of a
    cached or in-flight expert fails the request (AssertionError) as it is submitted."""
    out = Submissions()
    sched, submit, first = engine.scheduler, engine.fetch.submit, engine.model.config.moe_layers[0]

    def step(layer: int, h: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> None:
        if layer == first and h.shape[0] == 1:
            out.step += 1

    def watched(ref, priority=Priority.DEMAND, **kw):
        key = (ref.layer, ref.expert)
        if priority != Priority.DEMAND:
            if sched.cache is not None and key in sched.cache:
                out.of_cached.append(key)
            if key in sched.prefetches or key in sched.demands:
                out.of_inflight.append(key)
            # Fail at once: a second read of an expert in flight would orphan a read buffer and stall the run.
            assert not out.of_cached and not out.of_inflight, f"read ahead again: {out}"
            if out.step >= 0:
                out.prefetched.append((out.step, *key))
        return submit(ref, priority, **kw)

    engine.model.observers.insert(0, step)
    engine.fetch.submit = watched
    return out


def decode_routing(trace: Trace, moe_layers: list[int]) -> tuple[dict[int, torch.Tensor], dict[int, list[int]]]:
    """Split a recorded trace into decode routing (layer → [N, k]) and the prompt's experts per layer."""
    prefill, decode = trace.calls[: len(moe_layers)], trace.calls[len(moe_layers) :]
    ids = {layer: torch.tensor([e for lyr, e in decode if lyr == layer]) for layer in moe_layers}
    return ids, {layer: e for layer, e in prefill}


def oracle_scores(
    trace: Trace, moe_layers: list[int], lookahead: int, num_experts: int
) -> dict[tuple[int, int], torch.Tensor]:
    """What the oracle predictor scores at each decode step, as the simulator takes it: (source, target) → [N, E]."""
    decode = trace.calls[len(moe_layers) :]
    oracle = OraclePredictor(decode, moe_layers, lookahead=lookahead, num_experts=num_experts)
    rows: dict[tuple[int, int], list[torch.Tensor]] = {}
    one = torch.zeros(1, 1)
    for layer, _ in decode:
        pred = oracle.predict(layer, one)
        for target in pred.layers:
            rows.setdefault((layer, target), []).append(pred.for_layer(target))
        oracle.observe(layer)
    return {key: torch.cat(v) for key, v in rows.items()}


def simulate_engine(engine: Engine, trace: Trace):
    """The simulator over ``trace``'s decode with the engine's own policy, cache size and read buffers."""
    cfg = engine.model.config
    ids, warm = decode_routing(trace, cfg.moe_layers)
    preds = oracle_scores(trace, cfg.moe_layers, engine.policy.lookahead, cfg.num_experts)
    return simulate(
        ids,
        preds,
        engine.policy,
        engine.plan.cache_bytes,
        engine.plan.entry_bytes,
        LINK,
        HostCosts(1e-3),
        cfg.num_experts,
        cfg.num_hidden_layers,
        warm=warm,
        max_inflight=engine.scheduler.max_inflight,
    )


def record_with_predictions(store, config: GenerateConfig = CFG):
    """PROMPT under ``config`` on ``store``: (its Trace, each predictor's decode scores, the model config, (entry
    bytes, int4 slot bytes), the calibration popularity): what the simulator replays a request with."""
    from fate_edge.planning.host_costs import _DecodeRecorder
    from fate_edge.planning.plan_trace import trace_predictions

    with Engine(EngineConfig(store, "64MB", "lru")) as rec:
        seen = _DecodeRecorder()
        rec.model.observers.insert(0, seen)
        trace = rec.record_trace(PROMPT, config)
        ids = {layer: torch.cat(v) for layer, v in seen.ids.items()}
        gate_inputs = {layer: torch.cat(v) for layer, v in seen.h.items()}
        preds = trace_predictions(rec.model, ids, gate_inputs, store_dir=store).predictions
        sizes = (rec.plan.entry_bytes, rec.store.precisions[4].slot_bytes)
        return trace, preds, rec.model.config, sizes, rec.popularity
