"""How much one request's decode speed depends on its text, and what the planner's default probe predicts.

The planner (``--policy auto``) measures this host on sample text it carries (a stdlib module's source) and predicts
decode tok/s for a request over that text's routing. A user's request has other text, other routing and so another
hit rate. This script measures the spread: the device's ``fate-edge`` preset under the device emulation (as
``fate-edge bench --emulate``), one fresh engine per request, the same prompt length and decode length for N
different held-out stdlib texts, in interleaved rounds (median per text); beside it the planner's prediction from
its default probe, against the median request.

    python research/probe_text_spread.py --store STORE --device orin-nano --results

STORE: the bench's store (``fate-edge bench`` prints it; by default the inflated bundled model under the fate-edge
cache). Writes docs/results/probe_text_spread.md between its markers with ``--results``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from fate_edge.devices.link import ThrottledLink

from fate_edge.corpus import is_heldout, stdlib_files
from fate_edge.format.store import ExpertStore
from fate_edge.planning.emulation import calibrate
from fate_edge.planning.plan_presets import preset_candidates
from fate_edge.planning.planner import auto_plan
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge.runtime.generate import GenerateConfig
from fate_edge.tokenizer import Tokenizer
from fate_edge_lab.bench.host import cpu_model, load_average
from fate_edge_lab.bench.publish import add_results_arg, publish


def texts(tok: Tokenizer, n: int, prompt_tokens: int) -> list[tuple[str, list[int]]]:
    """``n`` held-out stdlib files spread over the library (every k-th), each at least ``prompt_tokens`` long."""
    files = [p for p in stdlib_files() if is_heldout(p, 0.02)]
    out = []
    for p in files[:: max(1, len(files) // (3 * n))]:
        try:
            ids = tok.encode(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        if len(ids) >= prompt_tokens:
            out.append((p.name, ids[:prompt_tokens]))
        if len(out) == n:
            break
    return out


def decode_tps(store: Path, budget: int, policy, em, ids: list[int], decode_tokens: int) -> float:
    """One request on a fresh engine: decode tokens over the time from the first streamed token to the last."""
    eng = Engine(EngineConfig(store, budget, policy, link=ThrottledLink(em.emulated), direct_io=em.direct_io))
    try:
        times = [
            time.perf_counter() for _ in eng.stream(ids, GenerateConfig(max_tokens=decode_tokens + 1, ignore_eos=True))
        ]
    finally:
        eng.close()
    return (len(times) - 1) / (times[-1] - times[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True)
    ap.add_argument("--device", default="orin-nano")
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.2, 0.35, 0.5])
    ap.add_argument("--texts", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default="/tmp/probe_text_spread.json")
    add_results_arg(ap, "write the table into docs/results/probe_text_spread.md (or FILE) between its markers")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    store = Path(args.store)
    st = ExpertStore(store)
    tok = Tokenizer(store)
    total = len(st.index["moe_layers"]) * st.index["num_experts"] * st.expert_bytes(4)
    sample = texts(tok, args.texts, args.prompt_tokens)
    em = calibrate(args.device, store, sample[0][1][:32])
    policy = preset_candidates(args.device, store)[0]
    rows = []
    for frac in args.budgets:
        budget = int(frac * total)
        runs: dict[str, list[float]] = {name: [] for name, _ in sample}
        for _ in range(args.rounds):  # interleaved: each round visits every text once
            for name, ids in sample:
                runs[name].append(decode_tps(store, budget, policy, em, ids, args.decode_tokens))
        per_text = {name: statistics.median(v) for name, v in runs.items()}
        plan = auto_plan(
            store,
            budget,
            link=em.emulated,
            direct_io=em.direct_io,
            device=args.device,
            prompt_tokens=args.prompt_tokens,
            decode_tokens=args.decode_tokens,
        )
        vals = list(per_text.values())
        mid = statistics.median(vals)
        rows.append(
            {
                "budget_fraction": frac,
                "per_text": per_text,
                "runs": runs,
                "median": mid,
                "cv": statistics.pstdev(vals) / statistics.mean(vals),
                "within_15pct_of_median": sum(abs(v / mid - 1) <= 0.15 for v in vals),
                "planner_pick": plan.policy.name,
                "planner_predicted_pick": plan.predicted_tokens_per_s,
                # the preset measured here, as the planner predicted it on its own probe text
                "planner_predicted": next(c.result.tokens_per_s for c in plan.presets if c.policy.name == "fate-edge"),
                "load_average": load_average(),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    result = {
        "device": args.device,
        "store": str(store),
        "cpu": cpu_model(),
        "threads": args.threads,
        "dilation_k": em.k,
        "prompt_tokens": args.prompt_tokens,
        "decode_tokens": args.decode_tokens,
        "rows": rows,
    }
    lines = [
        f"`fate-edge` preset on the emulated {args.device} (k = {em.k:.3g}), {len(sample)} held-out stdlib texts, "
        f"{args.prompt_tokens}-token prompt + {args.decode_tokens} greedy tokens, one fresh engine per request, "
        f"median of {args.rounds} interleaved rounds per text, raw host decode tok/s; CPU: {cpu_model()}, "
        f"{args.threads} threads.",
        "",
        "| budget | median request | slowest / fastest text | spread (CV) | texts within 15% of the median "
        "| planner's prediction for the preset, on its own probe text | its error vs the median request | load avg |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        v = list(r["per_text"].values())
        lines.append(
            f"| {100 * r['budget_fraction']:.0f}% | {r['median']:.1f} | {min(v):.1f} / {max(v):.1f} | "
            f"{100 * r['cv']:.0f}% | {r['within_15pct_of_median']} of {len(v)} | {r['planner_predicted']:.1f} | "
            f"{100 * (r['planner_predicted'] / r['median'] - 1):+.0f}% | "
            f"{'/'.join(str(x) for x in r['load_average'])} |"
        )
    publish(result, args.json, "\n".join(lines), args.results, "probe_text_spread")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
