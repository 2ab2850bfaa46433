"""The real-shape GPU benchmark: fate-edge resident and under expert budgets beside transformers (resident, and
offloaded with accelerate), on one synthetic checkpoint and its store, greedy, the same prompt ids for every run.

    python scripts/gpu_bench.py --model /tmp/qwen8 --store /tmp/qwen8-store --json out/gpu_bench.json \\
        --markdown out/gpu_bench.md --profile-dir out

Each fate-edge run serves a short warm-up request first (CUDA graph capture, kernel loads), then the measured one.
``--profile-dir`` adds torch.profiler's CUDA view of a few decode tokens per profiled run: the top operators by
GPU and by CPU time, and per token the wall time, the GPU's busy time, kernel launches and host syncs.

Each budgeted run's scheduler figures are split into the prompt's (prefill and the first sampled token) and the
decode's, per decode token (:func:`phases`): the stall and the main thread's time turning reads into experts, misses
served from the host tier or computed on the CPU, prefetches made ready as they landed. The fate-edge preset runs at
the first budget also without the host tier and with misses computed on the CPU (``miss_compute="hybrid"``).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import traceback
from dataclasses import fields
from pathlib import Path

import torch

from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge.runtime.generate import GenerateConfig, stream_from_model
from fate_edge.runtime.loader import load_model
from fate_edge.runtime.policy import PolicyConfig, get_policy
from fate_edge.runtime.scheduler_stats import SchedulerStats
from fate_edge.tokenizer import Tokenizer
from fate_edge_lab.bench.sidebyside import resident_int4
from fate_edge_lab.bounds.read_bound import decode_reads


def prompt_ids(vocab: int, n: int) -> list[int]:
    """The benchmark's prompt: ``n`` seeded random ids (every run and script that reproduces it uses these)."""
    return torch.randint(10, vocab, (n,), generator=torch.Generator().manual_seed(0)).tolist()


def _measure(stream) -> dict:
    last, tokens = None, []
    for last in stream:
        tokens.append(last.token)
    return {"decode_tps": last.generation_tps, "prefill_tps": last.prompt_tps, "tokens": tokens}


def _profile(make_stream, name: str, out: Path, skip: int = 4, steps: int = 8) -> dict:
    """torch.profiler over ``steps`` decode tokens after ``skip``: operator tables and a per-token account."""
    from torch.profiler import ProfilerActivity, profile

    it = iter(make_stream())
    for _ in range(skip):
        next(it)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            next(it)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    for _ in it:
        pass
    avg = prof.key_averages()

    def dev_time(e) -> float:
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

    (out / f"profile-{name}.txt").write_text(
        avg.table(sort_by="self_cuda_time_total", row_limit=25)
        + "\n\n"
        + avg.table(sort_by="self_cpu_time_total", row_limit=25)
    )
    count = {e.key: e.count for e in avg}
    syncs = sum(
        n for k, n in count.items() if k in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
    )
    copies = sum(n for k, n in count.items() if k.startswith("cudaMemcpy"))
    launches = sum(
        n
        for k, n in count.items()
        if k in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cudaGraphLaunch")
    )
    gpu_us = sum(dev_time(e) for e in avg if e.device_type == torch.autograd.DeviceType.CUDA)
    return {
        "wall_ms_per_token": wall / steps * 1e3,
        "gpu_busy_ms_per_token": gpu_us / steps / 1e3,
        "host_syncs_per_token": syncs / steps,
        "memcpy_calls_per_token": copies / steps,
        "launches_per_token": launches / steps,
        "top_gpu_ops": [(e.key, round(dev_time(e) / steps, 1)) for e in sorted(avg, key=dev_time, reverse=True)[:8]],
        "top_cpu_ops": [
            (e.key, round(e.self_cpu_time_total / steps, 1))
            for e in sorted(avg, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
        ],
    }


def run_resident(args, prompt: list[int], graphs: bool) -> dict:
    tok = Tokenizer(args.store)
    model = load_model(args.store, dtype="bfloat16", experts=resident_int4(args.store, "cuda"), device="cuda")
    model.cuda_graphs = graphs
    cfg = GenerateConfig(max_tokens=args.decode_tokens, ignore_eos=True)
    _measure(stream_from_model(model, tok, prompt[:16], GenerateConfig(max_tokens=4, ignore_eos=True)))
    row = _measure(stream_from_model(model, tok, prompt, cfg))
    row["graph"] = (
        f"captured {model.graphed.captures}x"
        if model.graphed is not None and model.graph_off is None
        else model.graph_off or "off"
    )
    if args.profile_dir:
        row["profile"] = _profile(
            lambda: stream_from_model(model, tok, prompt, cfg),
            f"resident-{'graph' if graphs else 'eager'}",
            args.profile_dir,
        )
    return row


def phases(engine: Engine) -> dict:
    """The last request's scheduler figures, its prompt apart from its decode (the whole request's mixed the prompt's
    many reads into the decode's): ``prefill`` in total (ms, counts), ``decode`` per decode token."""
    toks = engine.token_stats
    decode = SchedulerStats(**{f.name: sum(getattr(t, f.name) for t in toks) for f in fields(SchedulerStats)})
    out = {}
    for name, s, n in (("prefill", engine.prefill_stats, 1), ("decode", decode, max(1, len(toks)))):
        out[name] = {
            "tokens": len(toks) if name == "decode" else 1,
            "hit_rate": s.hit_rate,
            "stall_ms": s.stall_s * 1e3 / n,
            "consume_ms": s.consume_s * 1e3 / n,
            "misses": s.misses / n,
            "host_hits": s.host_hits / n,
            "cpu_computed": s.cpu_computed / n,
            "copied_up": s.copied_up / n,
            "landed_early": s.landed_early / n,
            "prefetch_hits": s.prefetch_hits / n,
        }
    return out


def run_engine(
    args, prompt: list[int], policy: str | PolicyConfig, budget: str, profile: bool, host_memory: str | int = "auto"
) -> dict:
    label = policy if isinstance(policy, str) else policy.name
    config = EngineConfig(args.store, budget, policy, dtype="bfloat16", device="cuda", host_memory=host_memory)
    with Engine(config) as engine:
        cfg = GenerateConfig(max_tokens=args.decode_tokens, ignore_eos=True)
        engine.generate_text(prompt[:16], GenerateConfig(max_tokens=4, ignore_eos=True))
        # the decode's expert reads beside the fewest any cache could make on the same routing
        try:
            responses, reads = decode_reads(engine, engine.stream(prompt, cfg))
            row = _measure(responses) | {"reads": reads}
        except Exception as e:  # noqa: BLE001 (the bound is an extra: the row's speed is still measured)
            row = _measure(engine.stream(prompt, cfg)) | {"reads_error": f"{type(e).__name__}: {e}"[:300]}
        s = engine.request_stats
        row.update(
            hit_rate=s.hit_rate,
            stall_s=s.stall_s,
            consume_s=s.consume_s,
            predict_s=s.predict_s,
            uploads=engine.scheduler.copier.uploads,
            phases=phases(engine),
            host_tier_bytes=engine.host_tier.held_bytes if engine.host_tier is not None else 0,
        )
        if profile and args.profile_dir:
            row["profile"] = _profile(lambda: engine.stream(prompt, cfg), f"{label}-{budget}", args.profile_dir)
    return row


def run_transformers(args, prompt: list[int], offload_gib: float | None, no_cudnn: bool = False) -> dict:
    """transformers as its users run it; ``no_cudnn``: its attention kept off cuDNN's per-shape plans too (the
    backends fate-edge uses), so the comparison is not won on that alone."""
    if no_cudnn:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            return run_transformers(args, prompt, offload_gib)
    from transformers import AutoModelForCausalLM

    kw = {"dtype": torch.bfloat16}
    if offload_gib is None:
        model = AutoModelForCausalLM.from_pretrained(args.model, **kw).cuda()
        n = args.decode_tokens
    else:
        model = AutoModelForCausalLM.from_pretrained(
            args.model, device_map="auto", max_memory={0: f"{offload_gib}GiB", "cpu": "100GiB"}, **kw
        )
        n = args.offload_tokens
    ids = torch.tensor([prompt], device="cuda")
    gen = {"do_sample": False, "pad_token_id": 0}
    model.generate(ids[:, :16], max_new_tokens=2, min_new_tokens=2, **gen)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **gen)
    torch.cuda.synchronize()
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **gen)
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    del model
    return {
        "decode_tps": (n - 1) / max(total - prefill, 1e-9),
        "prefill_tps": len(prompt) / prefill,
        "tokens": out[0, len(prompt) :].tolist(),
        "decode_tokens": n,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="the checkpoint (for transformers)")
    ap.add_argument("--store", type=Path, required=True, help="its fate-edge store")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--offload-tokens", type=int, default=8, help="decode tokens for the offloaded peer (slow)")
    ap.add_argument("--budgets", nargs="+", default=["1GB", "0.5GB"])
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--only", nargs="*", default=None, help="run only these rows (by name prefix)")
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--profile-dir", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_bench: torch sees no CUDA GPU; run this on a GPU machine")
    if args.profile_dir:
        args.profile_dir.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((args.store / "config.json").read_text())["vocab_size"]
    prompt = prompt_ids(vocab, args.prompt_tokens)
    runs: list[tuple[str, object]] = [
        ("fate-edge resident int4 (CUDA graph)", lambda: run_resident(args, prompt, True)),
        ("fate-edge resident int4 (eager)", lambda: run_resident(args, prompt, False)),
    ]
    for i, b in enumerate(args.budgets):
        runs.append((f"fate-edge preset {b}", lambda b=b, i=i: run_engine(args, prompt, "fate-edge", b, i == 0)))
    first = args.budgets[0]
    runs.append(
        (f"fate-edge preset {first}, no host tier", lambda: run_engine(args, prompt, "fate-edge", first, False, 0))
    )
    hybrid = get_policy("fate-edge").with_(miss_compute="hybrid")
    runs.append(
        (f"fate-edge preset {first}, misses on the CPU", lambda: run_engine(args, prompt, hybrid, first, False))
    )
    for b in args.budgets:
        runs.append((f"fate {b}", lambda b=b: run_engine(args, prompt, "fate", b, False)))
    runs.append(
        (
            f"load-on-demand-int4 {args.budgets[0]}",
            lambda: run_engine(args, prompt, "load-on-demand-int4", args.budgets[0], False),
        )
    )
    if not args.no_peers:
        runs.append(("transformers bf16 resident", lambda: run_transformers(args, prompt, None)))
        runs.append(
            (
                "transformers bf16 resident, SDPA without cuDNN",
                lambda: run_transformers(args, prompt, None, no_cudnn=True),
            )
        )
        runs.append(("transformers bf16 + accelerate offload 2 GiB", lambda: run_transformers(args, prompt, 2.0)))
    result = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "prompt_tokens": args.prompt_tokens,
        "decode_tokens": args.decode_tokens,
        "rows": {},
    }
    for name, fn in runs:
        if args.only is not None and not any(name.startswith(p) for p in args.only):
            continue
        t0 = time.perf_counter()
        try:
            row = fn()
        except Exception as e:  # noqa: BLE001 (one failed row is reported; the others still run)
            row = {"error": f"{type(e).__name__}: {e}"[:500], "trace": traceback.format_exc()[-2000:]}
        row["seconds"] = round(time.perf_counter() - t0, 1)
        result["rows"][name] = row
        gc.collect()
        torch.cuda.empty_cache()
        short = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k not in ("tokens",)}
        print(name, json.dumps(short, default=str)[:1500], flush=True)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str))
    if args.markdown:
        args.markdown.write_text(table(result))
    print(table(result))


def table(result: dict) -> str:
    rows = result["rows"]
    lod = next((r for n, r in rows.items() if n.startswith("load-on-demand") and "decode_tps" in r), None)
    off = next((r for n, r in rows.items() if "offload" in n and "decode_tps" in r), None)
    lines = [
        f"{result['gpu']}, torch {result['torch']} (CUDA {result['cuda']}), bf16, prompt "
        f"{result['prompt_tokens']} tokens, greedy decode {result['decode_tokens']} tokens; "
        "`scripts/gpu_bench.py`.",
        "",
        "| run | decode tok/s | prefill tok/s | x load-on-demand-int4 | x accelerate offload | hit rate |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        if "decode_tps" not in r:
            lines.append(f"| {name} | failed: {r.get('error', '?')[:80]} | | | | |")
            continue
        x_lod = f"{r['decode_tps'] / lod['decode_tps']:.1f}x" if lod else ""
        x_off = f"{r['decode_tps'] / off['decode_tps']:.1f}x" if off else ""
        hit = f"{r['hit_rate']:.1%}" if "hit_rate" in r else ""
        lines.append(f"| {name} | {r['decode_tps']:.1f} | {r['prefill_tps']:.0f} | {x_lod} | {x_off} | {hit} |")
    return "\n".join(lines + reads_table(rows) + phases_table(rows)) + "\n"


def phases_table(rows: dict) -> list[str]:
    """The budgeted runs' figures by phase (:func:`phases`): the prompt's in total, the decode's per token."""
    lines = [
        "",
        "| run | prompt: stall ms / consume ms | a decode token: stall ms / consume ms | misses: from the host tier "
        "/ on the CPU / all | made ready as landed |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        ph = r.get("phases")
        if not ph:
            continue
        p, d = ph["prefill"], ph["decode"]
        lines.append(
            f"| {name} | {p['stall_ms']:.1f} / {p['consume_ms']:.1f} | {d['stall_ms']:.2f} / {d['consume_ms']:.2f} "
            f"| {d['host_hits']:.2f} / {d['cpu_computed']:.2f} / {d['misses']:.2f} | {d['landed_early']:.2f} |"
        )
    return lines if len(lines) > 3 else []


def reads_table(rows: dict) -> list[str]:
    """The budgeted runs' expert reads per decode token beside the fewest any cache could make on the same routing
    (``fate_edge_lab.bounds.read_bound``), and the decode tokens/s those fewest reads alone allow at the reads'
    measured speed."""
    lines = [
        "",
        "| run | reads a decode token: engine / fewest (cache room) / fewest (whole budget) | read GB/s "
        "| decode tok/s the fewest reads allow |",
        "|---|---:|---:|---:|",
    ]
    for name, r in rows.items():
        x = r.get("reads")
        if not x:
            continue
        few, gbps = x["fewest_reads_per_token"], x["read_gbps"]
        cap = "no reads" if not few["cache_room"] else ""
        if few["cache_room"] and gbps:
            cap = f"{gbps * 1e9 / x['expert_bytes'] / few['cache_room']:.0f}"
        speed = f"{gbps:.2f}" if gbps else ""
        lines.append(
            f"| {name} | {x['engine_reads_per_token']:.2f} / {few['cache_room']:.2f} / {few['whole_budget']:.2f} "
            f"| {speed} | {cap} |"
        )
    return lines if len(lines) > 3 else []


if __name__ == "__main__":
    main()
