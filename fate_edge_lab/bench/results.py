"""Aggregation: medians over runs, one configuration from its rounds, same-run ratios, reference-token flags."""

from __future__ import annotations

import statistics
from typing import Any


def _median(values):
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarize_runs(runs: list[dict], decode_len: int) -> dict[str, Any]:
    """Medians over runs of the headline numbers."""
    med: dict[str, Any] = {
        "prefill_tps": {},
        "prefill_hit_rate": {},
        "prefill_stall_s": {},
        "prefill_mb": {},
        "prefill_low_precision": {},
    }
    for n in sorted({int(k) for r in runs for k in r["requests"]}):
        reqs = [r["requests"][str(n)] for r in runs]
        med["prefill_tps"][str(n)] = _median(q["prefill_tps"] for q in reqs)
        med["prefill_hit_rate"][str(n)] = _median(q["prefill"]["hit_rate"] for q in reqs)
        med["prefill_stall_s"][str(n)] = _median(q["prefill"]["stall_s"] for q in reqs)
        med["prefill_mb"][str(n)] = _median(
            (q["prefill"]["demand_bytes"] + q["prefill"]["prefetch_bytes"] + q["prefill"]["wasted_bytes"]) / 1e6
            for q in reqs
        )
        med["prefill_low_precision"][str(n)] = _median(q["prefill"]["low_precision"] for q in reqs)
    dec = [r["requests"][str(decode_len)] for r in runs]

    def per_tok(q, key):
        return q["decode"][key] / q["decode_tokens"] if q["decode_tokens"] else None

    med["decode_tps"] = _median(q["decode_tps"] for q in dec)
    med["stall_ms_per_token"] = _median(1e3 * per_tok(q, "stall_s") if q["decode_tokens"] else None for q in dec)
    med["mb_read_per_token"] = _median(
        (q["decode"]["demand_bytes"] + q["decode"]["prefetch_bytes"] + q["decode"]["wasted_bytes"])
        / q["decode_tokens"]
        / 1e6
        if q["decode_tokens"]
        else None
        for q in dec
    )
    med["demand_mb_per_token"] = _median(per_tok(q, "demand_bytes") / 1e6 if q["decode_tokens"] else None for q in dec)
    med["wasted_mb_per_token"] = _median(per_tok(q, "wasted_bytes") / 1e6 if q["decode_tokens"] else None for q in dec)
    med["misses_per_token"] = _median(per_tok(q, "misses") for q in dec)
    med["hit_rate"] = _median(q["decode"]["hit_rate"] for q in dec)
    med["exact_match"] = _median(q["decode"]["exact_match"] if q["decode"]["predictions"] else None for q in dec)
    med["recall"] = _median(q["decode"]["recall"] if q["decode"]["predictions"] else None for q in dec)
    return med


def merge_runs(parts: list[dict], decode_len: int) -> dict[str, Any]:
    """One configuration's result from its per-round worker results (one run each)."""
    out = dict(parts[0])
    out["runs"] = [run for p in parts for run in p["runs"]]
    out["median"] = summarize_runs(out["runs"], decode_len)
    out["peak_rss_bytes"] = max(p["peak_rss_bytes"] for p in parts)
    out["wall_s"] = sum(p["wall_s"] for p in parts)
    out["load_averages"] = [p["load_average"] for p in parts if p.get("load_average")]  # one per round
    layers: dict[str, dict[str, list[int]]] = {}
    for p in parts:
        for phase, per_layer in p["per_layer"].items():
            for layer, counts in per_layer.items():
                acc = layers.setdefault(phase, {}).setdefault(layer, [0, 0, 0])
                for j, v in enumerate(counts):
                    acc[j] += v
    out["per_layer"] = layers
    for p, run in zip(parts, out["runs"]):  # one run per part: same greedy tokens as the first part's?
        for q in run["requests"].values():
            q["tokens_equal_first_run"] = p["tokens"] == parts[0]["tokens"]
    predicted = [p["planner_predicted_decode_tps"] for p in parts if p.get("planner_predicted_decode_tps")]
    if predicted:  # the planner ran in every round's worker: its median prediction, and every choice it made
        out["planner_predicted_decode_tps"] = statistics.median(predicted)
        out["planner_predictions"] = predicted
        out["planner_policies"] = [p["policy"] for p in parts]
        for key in ("planner_predicted_on_run_routing", "preset_predicted_on_run_routing"):
            vals = [p[key] for p in parts if p.get(key)]
            if vals:  # the same costs over the measured request's own routing (worker.plan_in_worker)
                out[key] = statistics.median(vals)
        weighed = [p["planner_preset_predictions"] for p in parts if p.get("planner_preset_predictions")]
        if weighed:  # the presets it weighed on the same trace: median prediction per preset
            out["planner_preset_predictions"] = {
                name: statistics.median(d[name] for d in weighed if name in d) for name in weighed[0]
            }
    return out


def _ratio(a, b):
    return a / b if a is not None and b else None


def compute_ratios(results: list[dict]) -> None:
    """Ratios against load-on-demand (same link) and fate / oracle (same link and budget), from this run."""

    def find(link, preset, budget=None):
        for r in results:
            if (
                r.get("error") is None
                and r["link"] == link
                and r["preset"] == preset
                and (budget is None or r["budget_fraction"] == budget)
            ):
                return r
        return None

    for r in results:
        if r.get("error") is not None:
            continue
        refs = {
            "load-on-demand": find(r["link"], "load-on-demand"),
            "load-on-demand-int4": find(r["link"], "load-on-demand-int4"),
            "fate": find(r["link"], "fate", r["budget_fraction"]) if r["budget_fraction"] is not None else None,
            "oracle": find(r["link"], "oracle", r["budget_fraction"]) if r["budget_fraction"] is not None else None,
        }
        m = r["median"]
        ratios: dict[str, dict[str, float | None]] = {}
        for name, ref in refs.items():
            if ref is None:
                continue
            rm = ref["median"]
            ratios[name] = {"decode": _ratio(m["decode_tps"], rm["decode_tps"])}
            for n, v in m["prefill_tps"].items():
                ratios[name][f"prefill_{n}"] = _ratio(v, rm["prefill_tps"].get(n))
        r["ratios"] = ratios  # this / reference: > 1 is faster than the reference


def add_device_equivalent(results: list[dict], dilation: dict[str, float]) -> None:
    """On each emulated link (link key → its dilation k), the device-equivalent tokens/s = raw x k, kept apart
    from the raw figures measured on this host (``median``)."""
    for r in results:
        k = dilation.get(r.get("link", ""))
        if k is None or r.get("error") is not None:
            continue
        m = r["median"]
        r["device_equivalent"] = {
            "dilation_k": k,
            "decode_tps": None if m["decode_tps"] is None else m["decode_tps"] * k,
            "prefill_tps": {n: None if v is None else v * k for n, v in m["prefill_tps"].items()},
            "stall_ms_per_token": None if m["stall_ms_per_token"] is None else m["stall_ms_per_token"] / k,
            "planner_predicted_decode_tps": (
                r["planner_predicted_decode_tps"] * k if r.get("planner_predicted_decode_tps") else None
            ),
        }


def flag_reference_tokens(results: list[dict], reference: list[int] | None) -> None:
    """Flag each configuration whose greedy tokens differ from the int4 reference (the trace run)."""
    for r in results:
        if r.get("error") is None:
            r["tokens_match_int4_reference"] = None if reference is None else r["tokens"] == reference


def find_result(results, link, preset, budget):
    """The successful result of ``preset`` on ``link`` at ``budget`` (a no-cache preset at any budget), or None."""
    for r in results:
        if (
            r.get("error") is None
            and r["link"] == link
            and r["preset"] == preset
            and (r["budget_fraction"] is None or r["budget_fraction"] == budget)
        ):
            return r
    return None
