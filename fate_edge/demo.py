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

DEFAULT_PROMPT = "def fibonacci(n):"


def add_demo_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("demo", help="bundled model under a tight memory budget: fate-edge vs load-on-demand")
    p.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT, help=f"prompt (default {DEFAULT_PROMPT!r})")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--budget-fraction", type=float, default=0.35,
                   help="expert budget as a share of the int4 expert bytes (default 0.35)")
    p.add_argument("--memory-budget", default=None, help="explicit expert budget instead (e.g. 2MB)")
    p.add_argument("--policy", default="fate-edge", help="policy to show (default fate-edge)")
    p.add_argument("--baseline", default="load-on-demand", help="policy to compare with (default load-on-demand)")
    p.add_argument("--link", default="raspberry-pi-5-8gb",
                   help="device profile whose storage speed reads are throttled to, or 'none' (default "
                        "raspberry-pi-5-8gb)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto (default cpu)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: the bundled model is tiny, more threads only add overhead)")
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


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def run_policy(store, budget: int, policy: str, prompt: str, max_tokens: int, link_name: str | None, device: str,
               out=sys.stdout) -> RunResult:
    """Generate ``prompt`` greedily with ``policy`` under ``budget`` bytes, streaming the text to ``out``."""
    from .engine import Engine
    from .generate import GenerateConfig
    from .scheduler import SchedulerStats

    link = None
    if link_name:
        from fate_edge.devices.link import ThrottledLink, storage_link
        from fate_edge.devices.profile import load_profile

        link = ThrottledLink(storage_link(load_profile(link_name)))
    t0 = time.perf_counter()
    with Engine(store, budget, policy, link=link, device=device) as engine:
        cfg = GenerateConfig(max_tokens=max_tokens, ignore_eos=True)
        parts, last = [], None
        held = 0
        for last in engine.stream(prompt, cfg):
            parts.append(last.text)
            out.write(last.text)
            out.flush()
            held = max(held, (engine.cache.used_bytes if engine.cache is not None else 0) + engine.plan.pool_bytes)
        out.write("\n")
        s = engine.stats
        decode = SchedulerStats()
        for t in engine.token_stats:
            decode = SchedulerStats(**{k: getattr(decode, k) + getattr(t, k) for k in decode.__dataclass_fields__})
        n_decode = max(1, len(engine.token_stats))
        read = s.demand_bytes + s.prefetch_bytes + s.wasted_bytes
        decode_read = decode.demand_bytes + decode.prefetch_bytes + decode.wasted_bytes
        held += engine.plan.working_bytes
        return RunResult(
            policy=engine.policy.name, bits=engine.policy.bits, text="".join(parts),
            prompt_tokens=last.prompt_tokens, tokens=last.generation_tokens, decode_tps=last.generation_tps,
            prefill_s=last.prompt_tokens / last.prompt_tps if last.prompt_tps else 0.0, bytes_read=read,
            decode_bytes_per_token=decode_read / n_decode, hit_rate=s.hit_rate, decode_hit_rate=decode.hit_rate,
            stall_s=s.stall_s, expert_bytes_held=held, peak_rss=last.peak_rss_bytes,
            wall_s=time.perf_counter() - t0)


def summary(ours: RunResult, base: RunResult, budget: int, expert_bytes_int4: int, fraction: float | None,
            link_name: str | None) -> str:
    speed = ours.decode_tps / base.decode_tps if base.decode_tps else float("inf")
    fewer = base.decode_bytes_per_token / ours.decode_bytes_per_token if ours.decode_bytes_per_token else float("inf")

    def prec(r: RunResult) -> str:
        return "bf16" if r.bits == 16 else f"int{r.bits}"

    rows = [
        ("experts", f"{prec(ours)}, cached, prefetched when it pays", f"{prec(base)}, read when routed"),
        ("decode tokens/s", f"{ours.decode_tps:.1f}", f"{base.decode_tps:.1f}"),
        ("bytes read / token", _mb(ours.decode_bytes_per_token), _mb(base.decode_bytes_per_token)),
        ("bytes read in all", _mb(ours.bytes_read), _mb(base.bytes_read)),
        ("expert hit rate", f"{100 * ours.hit_rate:.1f}% (decode {100 * ours.decode_hit_rate:.1f}%)",
         f"{100 * base.hit_rate:.1f}%"),
        ("stall (waiting on reads)", f"{1e3 * ours.stall_s:.0f} ms", f"{1e3 * base.stall_s:.0f} ms"),
        ("expert memory held", f"{_mb(ours.expert_bytes_held)} <= {_mb(budget)}",
         f"{_mb(base.expert_bytes_held)} <= {_mb(budget)}"),
        ("process peak RSS", f"{ours.peak_rss / 2**20:.0f} MiB", f"{base.peak_rss / 2**20:.0f} MiB (cumulative)"),
        ("wall time", f"{ours.wall_s:.1f} s", f"{base.wall_s:.1f} s"),
    ]
    w0 = max(len(r[0]) for r in rows) + 2
    w1 = max(len(r[1]) for r in rows + [("", ours.policy)]) + 3
    lines = ["", f"{'':<{w0}}{ours.policy:<{w1}}{base.policy}"]
    lines += [f"{a:<{w0}}{b:<{w1}}{c}" for a, b, c in rows]
    share = f"{100 * fraction:.0f}% of the {_mb(expert_bytes_int4)} of int4 experts" if fraction else "set by hand"
    where = f"storage throttled to {link_name}" if link_name else "storage unthrottled"
    lines += ["", f"{ours.policy}: {speed:.1f}x the tokens/s of {base.policy}, {fewer:.1f}x fewer bytes read per "
              f"token, under an expert budget of {_mb(budget)} ({share}; {where}).",
              "Peak RSS is the whole process (Python, torch, resident weights); the budget bounds expert memory "
              "(cache, read buffers, the expert being computed)."]
    return "\n".join(lines)


def cmd_demo(args: argparse.Namespace) -> int:
    from .bundled import bundled_model_dir
    from .engine import parse_bytes, resolve_device
    from .errors import FateEdgeError
    from .store import ExpertStore, is_store
    from .store_cache import cache_root, ensure_store

    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    src = bundled_model_dir()
    print(f"fate-edge demo: bundled model {src.name} ({src})", flush=True)
    fresh = not any(cache_root().glob(f"{src.name}-int4-*")) if cache_root().exists() else True
    if fresh:
        print(f"converting it to an expert store (int4 + int2 + bf16) in {cache_root()} (once) ...", flush=True)
    store = ensure_store(src, progress=False)
    assert is_store(store)
    s = ExpertStore(store)
    n_experts = len(s.index["moe_layers"]) * s.index["num_experts"]
    int4_bytes = s.expert_bytes(4) * n_experts
    fraction = None
    if args.memory_budget:
        try:
            budget = parse_bytes(args.memory_budget)
        except ValueError as exc:
            raise FateEdgeError(str(exc)) from None
    else:
        if not 0 < args.budget_fraction <= 1:
            raise FateEdgeError(f"--budget-fraction must be in (0, 1], got {args.budget_fraction}")
        fraction = args.budget_fraction
        budget = int(fraction * int4_bytes)
    link = None if args.link in (None, "", "none") else args.link
    device = resolve_device(args.device)
    print(f"store {store}: {n_experts} experts in {len(s.index['moe_layers'])} MoE layers, "
          f"{_mb(int4_bytes)} at int4, {_mb(s.expert_bytes(16) * n_experts)} at bf16", flush=True)
    print(f"expert budget {_mb(budget)}" + (f" ({100 * fraction:.0f}% of the int4 experts)" if fraction else "")
          + (f"; reads throttled to {link}'s storage" if link else "") + f"; device {device}\n", flush=True)
    results = []
    for policy in (args.policy, args.baseline):
        print(f"--- {policy} ---", flush=True)
        sys.stdout.write(args.prompt)
        results.append(run_policy(store, budget, policy, args.prompt, args.max_tokens, link, device))
    ours, base = results
    print(summary(ours, base, budget, int4_bytes, fraction, link))
    print(f"\n(demo finished in {time.perf_counter() - t0:.1f} s)")
    return 0
