"""Issue 59 items 4 and 5 on a GPU: decode at an expert budget with one graph per token over the cache's slots
(``SlotGraphDecode``) against the per-layer graphs (``LayerGraphDecode``), resident prefill with the grouped
Triton kernels against the eager prefill, and prefill at the budget with the grouped kernels over staged blobs
(``runtime.staged_prefill``) against the eager one; on the real-shape slice, the prompt and token count of gpu_bench.

    python scripts/gpu_slot_prefill.py --store /tmp/q/store --portable-store /tmp/q/store-portable \\
        --budget 1GB --json out/slot_prefill.json

Rounds alternate the two runners (and the two prefills), each in a fresh engine (model) after a short warm-up
request (captures, kernel loads); the JSON keeps every round, the medians and whether the greedy tokens agree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from fate_edge.model.graph_step import LayerGraphDecode
from fate_edge.model.slot_step import SlotGraphDecode
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge.runtime.generate import GenerateConfig
from fate_edge.runtime.grouped_prefill import use_grouped_prefill
from fate_edge.runtime.loader import load_model
from fate_edge.runtime.staged_prefill import use_budgeted_grouped_prefill
from fate_edge_lab.bench.sidebyside import resident_int4


def prompt_ids(vocab: int, n: int) -> list[int]:
    """gpu_bench's prompt: ``n`` seeded random ids."""
    return torch.randint(10, vocab, (n,), generator=torch.Generator().manual_seed(0)).tolist()


def decode_round(args, prompt: list[int], runner: str) -> dict:
    cfg = EngineConfig(args.store, args.budget, args.policy, dtype=args.dtype, device=args.device)
    capture = args.device == "cuda"  # elsewhere the same code without graphs (a smoke run)
    with Engine(cfg) as engine:
        model = engine.model
        model.runner = SlotGraphDecode(model, capture) if runner == "slot" else LayerGraphDecode(model, capture)
        engine.generate_text(prompt[:16], GenerateConfig(max_tokens=4, ignore_eos=True))
        step = model.runner
        if isinstance(step, SlotGraphDecode):
            step.syncs_per_token.clear()
            step.reruns = step.eager_tokens = 0
        last, tokens = None, []
        for last in engine.stream(prompt, GenerateConfig(max_tokens=args.decode_tokens, ignore_eos=True)):
            tokens.append(last.token)
        assert last is not None
        row = {"runner": type(model.runner).__name__, "decode_tps": last.generation_tps, "tokens": tokens}
        row["hit_rate"] = engine.request_stats.hit_rate
        if isinstance(step, SlotGraphDecode):
            syncs = step.syncs_per_token
            row.update(
                failed=step.failed,
                slots=step.table.slots if step.table is not None else None,
                reruns=step.reruns,
                eager_tokens=step.eager_tokens,
                syncs_per_token=sum(syncs) / max(1, len(syncs)),
                tokens_with_one_sync=syncs.count(1),
            )
    return row


def prefill_round(args, prompt: list[int], grouped: bool) -> dict:
    store, dev = args.portable_store, args.device
    model = load_model(store, dtype=args.dtype, experts=resident_int4(store, dev), device=dev)
    if grouped:
        use_grouped_prefill(model, args.portable_store)
    ids = torch.tensor([prompt], device=dev)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    times = []
    with torch.inference_mode():
        for _ in range(3):  # the first warms the kernels
            sync()
            t0 = time.perf_counter()
            logits = model(ids, model.new_cache())
            sync()
            times.append(time.perf_counter() - t0)
    return {"grouped": grouped, "prefill_tps": len(prompt) / min(times[1:]), "logits": logits[0].float().cpu()}


def budget_prefill_round(args, prompt: list[int], grouped: bool) -> dict:
    """Prefill at ``--budget`` from the portable store: experts through the scheduler (eager) or the grouped kernels
    over blobs staged as their reads land (each run a fresh request, the cache as the last one left it)."""
    cfg = EngineConfig(args.portable_store, args.budget, args.policy, dtype=args.dtype, device=args.device, max_batch=1)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    with Engine(cfg) as engine:
        model = engine.model
        server = use_budgeted_grouped_prefill(engine) if grouped else None
        ids = torch.tensor([prompt], device=model.device)
        times = []
        with torch.inference_mode():
            for _ in range(3):  # the first warms the kernels
                engine.scheduler.new_sequence()
                sync()
                t0 = time.perf_counter()
                logits = model(ids, model.new_cache())
                sync()
                times.append(time.perf_counter() - t0)
        row = {
            "budget_grouped": grouped,
            "prefill_tps": len(prompt) / min(times[1:]),
            "logits": logits[0].float().cpu(),
        }
        row["stall_s"] = engine.scheduler.stats.stall_s
        if server is not None:
            row.update(sources=dict(server.sources), staging_bytes=server.nbytes)
    return row


def compare_prefills(
    args,
    prompt: list[int],
    out: dict,
    rows_key: str,
    flag: str,
    run: Callable[..., dict],
    diff_key: str,
    median_key: str,
    agree_key: str | None = None,
) -> None:
    """``--prefill-rounds`` rounds of ``run`` eager then grouped, each row (flagged ``flag``) into ``out[rows_key]``;
    then into ``out`` the two's largest logit difference (``diff_key``), where asked the share of positions whose
    argmax agrees (``agree_key``), and each one's median tokens per second (``median_key`` with eager or grouped)."""
    rows, logits = out.setdefault(rows_key, []), {}
    for _ in range(args.prefill_rounds):
        for grouped in (False, True):
            try:
                row = run(args, prompt, grouped)
                logits[grouped] = row.pop("logits")
            except Exception as e:  # noqa: BLE001 (the row says what failed; the other rows still run)
                row = {flag: grouped, "error": traceback.format_exception_only(e)[-1].strip()}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if len(logits) == 2:
        out[diff_key] = (logits[True] - logits[False]).abs().max().item()
        if agree_key is not None:
            out[agree_key] = float((logits[True].argmax(-1) == logits[False].argmax(-1)).float().mean())
    for grouped in (False, True):
        tps = [r["prefill_tps"] for r in rows if r.get(flag) is grouped and "error" not in r]
        out[median_key.format("grouped" if grouped else "eager")] = statistics.median(tps) if tps else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True, help="the slice's store (the default layout)")
    ap.add_argument("--portable-store", help="the slice converted with --layout portable (grouped prefill)")
    ap.add_argument("--budget", default="1GB")
    ap.add_argument("--policy", default="fate-edge")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="decode rounds of each runner")
    ap.add_argument("--prefill-rounds", type=int, default=1, help="prefill rounds of each (each the best of 2 runs)")
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run without graphs (TRITON_INTERPRET=1 for prefill)")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    vocab = json.loads((Path(args.store) / "config.json").read_text())["vocab_size"]
    prompt = prompt_ids(vocab, args.prompt_tokens)
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else args.device
    out: dict = {"device": name, "budget": args.budget, "decode": [], "prefill": []}
    for _ in range(args.rounds):
        for runner in ("layer", "slot"):
            try:
                out["decode"].append(decode_round(args, prompt, runner))
            except Exception as e:  # noqa: BLE001 (the row says what failed; the other rows still run)
                out["decode"].append({"runner": runner, "error": traceback.format_exception_only(e)[-1].strip()})
            print(json.dumps({k: v for k, v in out["decode"][-1].items() if k != "tokens"}), flush=True)
    ok = [r for r in out["decode"] if "error" not in r]
    for name in ("LayerGraphDecode", "SlotGraphDecode"):
        tps = [r["decode_tps"] for r in ok if r["runner"] == name]
        out[f"median_decode_tps_{name}"] = statistics.median(tps) if tps else None
    out["decode_tokens_agree"] = len({tuple(r["tokens"]) for r in ok}) == 1 if ok else None
    if args.portable_store:  # resident, then at the budget: each grouped against the eager prefill
        resident = ("prefill_max_abs_logit_diff", "median_prefill_tps_{}")
        compare_prefills(args, prompt, out, "prefill", "grouped", prefill_round, *resident, "prefill_argmax_agree")
        budget = ("prefill_budget_max_abs_logit_diff", "median_budget_prefill_tps_{}")
        compare_prefills(args, prompt, out, "budget_prefill", "budget_grouped", budget_prefill_round, *budget)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k.startswith(("median", "decode_tokens", "prefill_"))}))


if __name__ == "__main__":
    main()
