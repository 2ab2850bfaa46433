"""``fate-edge demo``: the bundled model under a tight expert budget, our policy against load-on-demand.

1. Converts the bundled model to an expert store in the cache directory (once; ``FATE_EDGE_CACHE``
   overrides ``~/.cache/fate-edge``).
2. Generates from one prompt with the ``fate-edge`` policy (int4 experts, cache + predictive prefetch)
   under a budget of 35% of the int4 expert bytes, reading experts through a throttled storage link
   (a Raspberry Pi 5's by default), then the same prompt with ``load-on-demand`` (bf16, nothing cached).
3. Prints a side-by-side summary: decode tokens/s and their ratio, bytes read per token, expert hit
   rate, stall time, and memory (expert memory held vs the budget, and the process's peak RSS).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from fate_edge.errors import FateEdgeError
from fate_edge.runtime.policy import POLICY_CHOICES
from fate_edge.sizes import format_bytes

# The bundled model is a 13 M-parameter MoE trained on Python's standard library on 2 CPU threads: it writes text
# shaped like that code, and greedy decoding alone soon loops on a phrase, so the demo keeps a light repetition
# penalty (the same for both policies) and a prompt it continues well.
DEFAULT_PROMPT = "import os\n\n\ndef "
DEFAULT_REPETITION_PENALTY = 1.2
MODEL_NOTE = (
    "tiny-moe is a 13 M-parameter model trained for 100 minutes on 2 CPU threads on Python's standard "
    "library: it writes Python-shaped text, not working code. The demo is about speed and memory under a "
    "budget; run your own model with `fate-edge run --model DIR`."
)


def add_demo_parser(sub) -> argparse.ArgumentParser:
    from fate_edge.apps.cli_args import (
        add_policy_arg,
        byte_size,
        device_name,
        fraction,
        link_name,
        non_negative_int,
        positive_float,
        positive_int,
    )

    p = sub.add_parser("demo", help="bundled model under a tight memory budget: fate-edge vs load-on-demand")
    p.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT, help=f"prompt (default {DEFAULT_PROMPT!r})")
    p.add_argument("--max-tokens", type=non_negative_int, default=48)
    p.add_argument(
        "--repetition-penalty",
        type=positive_float,
        default=DEFAULT_REPETITION_PENALTY,
        help=f"greedy decoding with this penalty, 1 disables it (default {DEFAULT_REPETITION_PENALTY})",
    )
    p.add_argument(
        "--budget-fraction",
        type=fraction,
        default=0.35,
        help="expert budget as a share of the int4 expert bytes (default 0.35)",
    )
    p.add_argument("--memory-budget", default=None, type=byte_size, help="explicit expert budget instead (e.g. 2MB)")
    add_policy_arg(p, "fate-edge")
    p.add_argument(
        "--baseline",
        default="load-on-demand",
        choices=[c for c in POLICY_CHOICES if c != "auto"],
        metavar="POLICY",
        help="policy to compare with (default load-on-demand)",
    )
    p.add_argument(
        "--link",
        default="raspberry-pi-5-8gb",
        type=link_name,
        help="device profile whose storage speed reads are throttled to, or 'none' (default raspberry-pi-5-8gb)",
    )
    p.add_argument("--device", default="cpu", type=device_name, help="cpu, cuda or auto (default cpu)")
    p.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        help="torch CPU threads (default 1: the bundled model is tiny, more threads only add overhead)",
    )
    p.set_defaults(func=cmd_demo)
    return p


@dataclass
class RunResult:
    policy: str
    bits: int
    text: str
    prompt_tokens: int
    tokens: int
    decode_tps: float
    prefill_s: float
    bytes_read: int
    decode_bytes_per_token: float
    hit_rate: float
    decode_hit_rate: float
    stall_s: float
    expert_bytes_held: int
    peak_rss: int
    wall_s: float


def run_policy(
    engine, prompt: str, max_tokens: int, open_s: float = 0.0, out=sys.stdout, repetition_penalty: float = 1.0
) -> RunResult:
    """Generate ``prompt`` greedily (with ``repetition_penalty``) with an open engine, streaming the text to ``out``;
    ``open_s``: the time the engine took to open (counted in the wall time)."""
    from fate_edge.runtime.generate import GenerateConfig
    from fate_edge.runtime.scheduler import SchedulerStats

    t0 = time.perf_counter() - open_s
    from fate_edge.runtime.sampling import SamplingParams

    cfg = GenerateConfig(
        max_tokens=max_tokens, ignore_eos=True, sampling=SamplingParams(repetition_penalty=repetition_penalty)
    )
    parts, last = [], None
    held = 0
    for last in engine.stream(prompt, cfg):
        parts.append(last.text)
        out.write(last.text)
        out.flush()
        held = max(held, (engine.cache.used_bytes if engine.cache is not None else 0) + engine.plan.pool_bytes)
    out.write("\n")
    if last is None:
        raise FateEdgeError("the demo generated no token: give max_tokens >= 1")
    s = engine.stats
    decode = SchedulerStats()
    for t in engine.token_stats:
        decode = SchedulerStats(**{k: getattr(decode, k) + getattr(t, k) for k in decode.__dataclass_fields__})
    n_decode = max(1, len(engine.token_stats))
    read = s.demand_bytes + s.prefetch_bytes + s.wasted_bytes
    decode_read = decode.demand_bytes + decode.prefetch_bytes + decode.wasted_bytes
    held += engine.plan.working_bytes
    return RunResult(
        policy=engine.policy.name,
        bits=engine.policy.bits,
        text="".join(parts),
        prompt_tokens=last.prompt_tokens,
        tokens=last.generation_tokens,
        decode_tps=last.generation_tps,
        prefill_s=last.prompt_tokens / last.prompt_tps if last.prompt_tps else 0.0,
        bytes_read=read,
        decode_bytes_per_token=decode_read / n_decode,
        hit_rate=s.hit_rate,
        decode_hit_rate=decode.hit_rate,
        stall_s=s.stall_s,
        expert_bytes_held=held,
        peak_rss=last.peak_rss_bytes,
        wall_s=time.perf_counter() - t0,
    )


def summary(
    ours: RunResult, base: RunResult, budget: int, expert_bytes_int4: int, fraction: float | None, link_name: str | None
) -> str:
    speed = ours.decode_tps / base.decode_tps if base.decode_tps else float("inf")
    fewer = base.decode_bytes_per_token / ours.decode_bytes_per_token if ours.decode_bytes_per_token else float("inf")

    def prec(r: RunResult) -> str:
        return "bf16" if r.bits == 16 else f"int{r.bits}"

    rows = [
        ("experts", f"{prec(ours)}, cached, prefetched when it pays", f"{prec(base)}, read when routed"),
        ("decode tokens/s", f"{ours.decode_tps:.1f}", f"{base.decode_tps:.1f}"),
        ("bytes read / token", format_bytes(ours.decode_bytes_per_token), format_bytes(base.decode_bytes_per_token)),
        ("bytes read in all", format_bytes(ours.bytes_read), format_bytes(base.bytes_read)),
        (
            "expert hit rate",
            f"{100 * ours.hit_rate:.1f}% (decode {100 * ours.decode_hit_rate:.1f}%)",
            f"{100 * base.hit_rate:.1f}%",
        ),
        ("stall (waiting on reads)", f"{1e3 * ours.stall_s:.0f} ms", f"{1e3 * base.stall_s:.0f} ms"),
        (
            "expert memory held",
            f"{format_bytes(ours.expert_bytes_held)} <= {format_bytes(budget)}",
            f"{format_bytes(base.expert_bytes_held)} <= {format_bytes(budget)}",
        ),
        ("process peak RSS", format_bytes(ours.peak_rss), f"{format_bytes(base.peak_rss)} (cumulative)"),
        ("wall time", f"{ours.wall_s:.1f} s", f"{base.wall_s:.1f} s"),
    ]
    w0 = max(len(r[0]) for r in rows) + 2
    w1 = max(len(r[1]) for r in rows + [("", ours.policy)]) + 3
    lines = ["", f"{'':<{w0}}{ours.policy:<{w1}}{base.policy}"]
    lines += [f"{a:<{w0}}{b:<{w1}}{c}" for a, b, c in rows]
    share = (
        f"{100 * fraction:.0f}% of the {format_bytes(expert_bytes_int4)} of int4 experts" if fraction else "set by hand"
    )
    where = f"storage throttled to {link_name}" if link_name else "storage unthrottled"
    lines += [
        "",
        f"{ours.policy}: {speed:.1f}x the tokens/s of {base.policy}, {fewer:.1f}x fewer bytes read per "
        f"token, under an expert budget of {format_bytes(budget)} ({share}; {where}).",
        "Peak RSS is the whole process (Python, torch, resident weights); the budget bounds expert memory "
        "(cache, read buffers, the expert being computed).",
    ]
    return "\n".join(lines)


def cmd_demo(args: argparse.Namespace) -> int:
    from contextlib import ExitStack

    from fate_edge.apps.engine_args import EngineOptions, open_engine
    from fate_edge.bundled import bundled_model_dir
    from fate_edge.format.converted_stores import cache_root, ensure_store
    from fate_edge.format.store import ExpertStore
    from fate_edge.runtime.auto_threads import set_load_threads
    from fate_edge.runtime.budget import parse_bytes
    from fate_edge.runtime.engine import resolve_device

    set_load_threads(args.threads)
    t0 = time.perf_counter()
    src = bundled_model_dir()
    device = resolve_device(args.device)
    fresh = not any(cache_root().glob(f"{src.name}-int4-*")) if cache_root().exists() else True
    if fresh:
        print(
            f"bundled model {src.name}: converting it to an expert store (int4 + int2 + bf16: the baseline reads "
            f"bf16) in {cache_root()} (once) ...",
            flush=True,
        )
    store = ensure_store(src, cold_bits=2, progress=False, baselines=True)
    s = ExpertStore(store)
    n_experts = len(s.index["moe_layers"]) * s.index["num_experts"]
    int4_bytes = s.expert_bytes(4) * n_experts
    fraction = None if args.memory_budget else args.budget_fraction
    budget = parse_bytes(args.memory_budget) if args.memory_budget else int(fraction * int4_bytes)
    link = None if args.link in (None, "", "none") else args.link
    with ExitStack() as stack:
        # Both engines open before anything is printed: a budget too small for either fails here, at once.
        engines = []
        for policy in (args.policy, args.baseline):
            t = time.perf_counter()
            opts = EngineOptions(model=str(store), memory_budget=str(budget), policy=policy, device=device, link=link)
            engines.append((stack.enter_context(open_engine(opts, progress=False)), time.perf_counter() - t))
        print(f"fate-edge demo: bundled model {src.name} ({src})", flush=True)
        print(MODEL_NOTE, flush=True)
        print(
            f"store {store}: {n_experts} experts in {len(s.index['moe_layers'])} MoE layers, "
            f"{format_bytes(int4_bytes)} at int4, {format_bytes(s.expert_bytes(16) * n_experts)} at bf16",
            flush=True,
        )
        print(
            f"expert budget {format_bytes(budget)}"
            + (f" ({100 * fraction:.0f}% of the int4 experts)" if fraction else "")
            + (f"; reads throttled to {link}'s storage" if link else "")
            + f"; device {device}\n",
            flush=True,
        )
        results = []
        for policy, (engine, open_s) in zip((args.policy, args.baseline), engines):
            print(f"--- {policy} ---", flush=True)
            sys.stdout.write(args.prompt)
            results.append(
                run_policy(engine, args.prompt, args.max_tokens, open_s, repetition_penalty=args.repetition_penalty)
            )
    ours, base = results
    print(summary(ours, base, budget, int4_bytes, fraction, link))
    print(f"\n(demo finished in {time.perf_counter() - t0:.1f} s)")
    return 0
