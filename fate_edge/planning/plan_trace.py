"""What the planner simulates over: a request's routing and each predictor's scores, recorded once (from a
teacher-forced run, the engine's own recorded calls, or its decode), and what it needs of the store beside them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch


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
    from fate_edge.predictors.base import Predictor
    from fate_edge.predictors.cross_layer_gate import CrossLayerGate
    from fate_edge.predictors.learned import LearnedPredictor, find_learned
    from fate_edge.predictors.previous_input import widen_inputs

    out = PlanTrace(expert_ids, {}, model.config.num_experts, model.config.num_hidden_layers)
    layers = sorted(expert_ids)
    predictors: dict[str, Predictor] = {
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


def sample_token_ids(tokenizer, n: int = 256) -> list[int]:
    """Calibration text that exists offline everywhere: a Python standard-library module's source."""
    import json as _json_module

    text = open(_json_module.decoder.__file__, encoding="utf-8").read()
    return tokenizer.encode(text)[:n]


def describe_store(trace: PlanTrace, store) -> None:
    """What the simulator needs of the store beside routing: calibration counts, and each precision's expert bytes
    (Fate's resident first layer is held at the highest that fits)."""
    from fate_edge.format.popularity import store_popularity

    trace.popularity = store_popularity(store.path)
    trace.entry_bytes = {b: store.expert_bytes(b) for b in store.precisions}
