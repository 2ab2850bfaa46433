"""A chat's second turn with the prompt cache on and off: prefill tokens and time to first token.

The bundled model has 1,024 positions, too few for the ~1,500-token conversation this measures, so the model is a lab
synthetic one (``fate_edge_lab.synthetic``: Qwen1.5-MoE-A2.7B's published shape, widths / ``--scale``, ``--layers``
layers, 8,192 positions), built once under ``--work`` and served with int4 experts streamed under ``--budget``.

Per round, for each of two batching engines (``prompt_cache`` auto and 0; the order alternates by round): the cache is
emptied, turn 1 (a ~1,500-token prompt, a new one each round) runs to its ``--answer`` greedy tokens, then turn 2 (turn
1's prompt and answer plus a new ~50-token message) runs to its first token. Recorded: each turn's prefill tokens (the
prompt less the positions the cache supplied) and time to first token. Medians over rounds; the load average and CPU
beside them.

    python research/prompt_cache_turns.py --rounds 5 --out docs/results/prompt-cache-turns.json --results

``--from-json FILE`` rewrites the table from a saved result without measuring.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from fate_edge.runtime.engine import Engine
from fate_edge.runtime.generate import GenerateConfig
from fate_edge_lab.bench.publish import add_results_arg, publish


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "")
    except OSError:
        return platform.processor()


def build(work: Path, layers: int, scale: int) -> Path:
    from fate_edge_lab.synthetic.build import SyntheticOptions, make_synthetic_model

    ckpt = work / f"qwen15-moe-{layers}l-s{scale}"
    if not (ckpt / "config.json").exists():
        make_synthetic_model(ckpt, SyntheticOptions("qwen1.5-moe-a2.7b", layers=layers, scale=scale))
    return ckpt


def text_of(tokens: int, seed: int, engine: Engine) -> list[int]:
    """About ``tokens`` tokens of Python source (the standard library's), a different stretch per ``seed``."""
    import inspect
    import json as mod_a
    import statistics as mod_b

    src = inspect.getsource(mod_a.decoder) + inspect.getsource(mod_b) + inspect.getsource(argparse)
    ids = engine.tokenizer.encode(src)
    start = (seed * 997) % max(1, len(ids) - tokens)
    return ids[start : start + tokens]


def ttft(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """Seconds to the first token, and the greedy answer's token ids (read to its end)."""
    cfg = GenerateConfig(max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    first = None
    tokens = []
    for step in engine.stream(prompt, cfg):
        if first is None:
            first = time.perf_counter() - t0
        if step.token is not None:
            tokens.append(step.token)
    assert first is not None
    return first, tokens


def table(result: dict) -> str:
    """The docs table (docs/results/prompt-cache.md, between its markers) of one result."""
    s, rows = result["summary"], result["rounds"]
    lines = [
        f"{result['model']}; experts {result['experts']}, {result['dtype']}, {result['threads']} thread(s), max_batch "
        f"{result['max_batch']}, prompt cache room {result['prompt_cache_room_bytes'] / 1e6:.1f} MB. CPU: "
        f"{result['cpu']}, load average {result['loadavg_start_end'][0]:.1f} at the start, "
        f"{result['loadavg_start_end'][1]:.1f} at the end. Medians of {len(rows) // 2} interleaved rounds.",
        "",
        "| | turn 1 prefill tokens | turn 1 TTFT (s) | turn 2 prompt tokens | turn 2 prefill tokens "
        "| turn 2 TTFT (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mode in ("off", "on"):
        x = s["medians"][mode]
        lines.append(
            f"| cache {mode} | {x['turn1_prefill_tokens']:.0f} | {x['turn1_ttft_s']:.2f} | "
            f"{x['turn2_prompt_tokens']:.0f} | {x['turn2_prefill_tokens']:.0f} | {x['turn2_ttft_s']:.3f} |"
        )
    per = ", ".join(
        " / ".join(
            f"{r['turn2_ttft_s']:.3f}" for m in ("on", "off") for r in rows if (r["round"], r["cache"]) == (i, m)
        )
        for i in sorted({r["round"] for r in rows})
    )
    lines += [
        "",
        f"Turn 2 prefills {100 * s['turn2_prefill_share_of_turn1']:.1f}% of turn 1's tokens (target: at most 10%); its "
        f"first token comes at {s['turn2_ttft_on_over_off']:.2f}x the cache-off time (target: at most 0.25x). Turn 2 "
        f"TTFT per round, on / off (s): {per}.",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/fate-edge-prompt-cache"))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--scale", type=int, default=4)
    ap.add_argument("--budget", default="12MB", help="expert memory budget (experts stream past it)")
    ap.add_argument("--first", type=int, default=1500, help="turn 1's prompt tokens")
    ap.add_argument("--new", type=int, default=50, help="turn 2's new message tokens")
    ap.add_argument("--answer", type=int, default=16, help="turn 1's answer tokens")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--from-json", type=Path, help="a saved result: rewrite its table, measure nothing")
    add_results_arg(ap, "rewrite the table between the prompt-cache markers of docs/results/prompt-cache.md")
    args = ap.parse_args()
    if args.from_json:
        result = json.loads(args.from_json.read_text())
        publish(result, args.from_json, table(result), args.results, "prompt-cache")
        return
    torch.set_num_threads(args.threads)
    ckpt = build(args.work, args.layers, args.scale)
    kw = dict(memory_budget=args.budget, device="cpu", dtype="bfloat16", threads=args.threads, context_tokens=4096)
    engines = {"on": Engine.load(ckpt, prompt_cache="auto", **kw), "off": Engine.load(ckpt, prompt_cache=0, **kw)}
    rows = []
    for r in range(args.rounds):
        order = ["on", "off"] if r % 2 == 0 else ["off", "on"]
        for mode in order:
            eng = engines[mode]
            if eng.prompt_cache is not None:
                eng.prompt_cache.clear()
            first = text_of(args.first, r, eng)
            t1, answer = ttft(eng, first, args.answer)
            second = first + answer + text_of(args.new, r + 101, eng)
            saved = eng.prompt_cache.stats.tokens_saved if eng.prompt_cache else 0
            t2, _ = ttft(eng, second, 1)
            reused = (eng.prompt_cache.stats.tokens_saved - saved) if eng.prompt_cache else 0
            rows.append(
                {
                    "round": r,
                    "cache": mode,
                    "turn1_prefill_tokens": len(first),
                    "turn1_ttft_s": round(t1, 4),
                    "turn2_prompt_tokens": len(second),
                    "turn2_prefill_tokens": len(second) - reused,
                    "turn2_ttft_s": round(t2, 4),
                    "loadavg": os.getloadavg()[0],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    med = {}
    for mode in ("on", "off"):
        mine = [x for x in rows if x["cache"] == mode]
        med[mode] = {k: statistics.median(x[k] for x in mine) for k in mine[0] if k not in ("round", "cache")}
    summary = {
        "turn2_prefill_share_of_turn1": med["on"]["turn2_prefill_tokens"] / med["on"]["turn1_prefill_tokens"],
        "turn2_ttft_on_over_off": med["on"]["turn2_ttft_s"] / med["off"]["turn2_ttft_s"],
        "medians": med,
    }
    e = engines["on"]
    result = {
        "what": "second chat turn with the prompt cache on vs off (research/prompt_cache_turns.py)",
        "model": f"synthetic qwen1.5-moe-a2.7b shape, {args.layers} layers, widths / {args.scale} "
        "(the bundled model holds 1,024 positions, too few)",
        "experts": f"int4, {e.policy.name}, memory budget {args.budget}",
        "dtype": "bfloat16",
        "threads": args.threads,
        "max_batch": e.max_batch,
        "prompt_cache_room_bytes": e.account.prompt_cache,
        "cpu": cpu_model(),
        "loadavg_start_end": [rows[0]["loadavg"], rows[-1]["loadavg"]],
        "rounds": rows,
        "summary": summary,
    }
    for eng in engines.values():
        eng.close()
    publish(result, args.out or args.work / "prompt-cache-turns.json", table(result), args.results, "prompt-cache")


if __name__ == "__main__":
    main()
