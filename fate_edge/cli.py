"""``fate-edge`` command line: a thin dispatcher over the library (run, inspect)."""

from __future__ import annotations

import argparse
import sys
import time

from .errors import FateEdgeError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="Hugging Face model directory (default: the bundled tiny model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto (cuda when torch sees a GPU)")
    p.add_argument("--experts", default="memory", choices=["memory", "lazy"],
                   help="memory: all experts resident; lazy: read each routed expert from disk when needed")
    p.add_argument("--bits", type=int, default=None,
                   help="expert store only: precision to stream (16 = bf16; default: the store's quantized copy)")
    p.add_argument("--link", default=None,
                   help="expert store only: throttle reads to a device profile's storage link (see devices/profiles)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")


def cmd_run(args: argparse.Namespace) -> int:
    from .bundled import bundled_model_dir
    from .engine import resolve_device
    from .generate import GenerateConfig, stream_generate
    from .loader import load_model
    from .sampling import SamplingParams
    from .tokenizer import Tokenizer

    device = resolve_device(args.device)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    model_dir = args.model or bundled_model_dir()
    link = None
    if args.link:
        from fate_edge.devices.link import ThrottledLink, storage_link
        from fate_edge.devices.profile import load_profile

        if args.link == "host":
            from fate_edge.devices.probe import host_profile

            link = ThrottledLink(storage_link(host_profile()))
        else:
            link = ThrottledLink(storage_link(load_profile(args.link)))
    engine = None
    if args.memory_budget or args.policy:
        from .engine import Engine
        from .store_cache import ensure_store

        store = ensure_store(model_dir)
        engine = Engine(store, args.memory_budget or "1GB", args.policy or "fate-edge", dtype=args.dtype, link=link,
                        device=device, verify=args.verify)
        model, tokenizer = engine.model, engine.tokenizer
    else:
        model = load_model(model_dir, dtype=args.dtype, experts=args.experts, bits=args.bits, link=link,
                           device=device)
        tokenizer = Tokenizer(model_dir)
    if args.chat:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p, args.repetition_penalty, args.seed)
    config = GenerateConfig(args.max_tokens, sampling, stop=args.stop, ignore_eos=args.ignore_eos)
    last = None
    if args.echo:
        sys.stdout.write(prompt)
    steps = engine.stream(prompt, config) if engine else stream_generate(model, tokenizer, prompt, config)
    for last in steps:
        sys.stdout.write(last.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if last is not None:
        print(
            f"[{last.prompt_tokens} prompt tokens at {last.prompt_tps:.1f} tok/s, "
            f"{last.generation_tokens} generated at "
            f"{last.generation_tps:.1f} tok/s, finish: {last.finish_reason}, peak RSS "
            f"{last.peak_rss_bytes / 2**20:.0f} MB]",
            file=sys.stderr,
        )
    if engine is not None:
        s = engine.stats
        print(
            f"[policy {engine.policy.name}, expert budget {engine.budget / 1e6:.1f} MB (cache "
            f"{engine.plan.cache_bytes / 1e6:.1f} MB): hit rate {100 * s.hit_rate:.1f}% ({s.hits} cached, "
            f"{s.prefetch_hits} prefetched, {s.misses} demand reads), stall {1e3 * s.stall_s:.0f} ms, read "
            f"{(s.demand_bytes + s.prefetch_bytes) / 1e6:.1f} MB ({s.demand_bytes / 1e6:.1f} on the critical path), "
            f"wasted {s.wasted_bytes / 1e6:.1f} MB, prediction exact {100 * s.exact_match:.0f}%]",
            file=sys.stderr,
        )
        engine.close()
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from .bundled import bundled_model_dir
    from .inspect_model import format_store, format_summary, summarize
    from .store import is_store

    path = args.model_dir or bundled_model_dir()
    print(format_summary(summarize(path)))
    if is_store(path):
        print()
        print(format_store(path))
        if args.verify:
            from .store import ExpertStore

            t0 = time.perf_counter()
            checked = ExpertStore(path).verify()  # raises CorruptBlobError naming the first bad blob
            print(f"verified        every blob's CRC32: {checked / 1e6:.1f} MB in {time.perf_counter() - t0:.1f} s, "
                  "all intact")
    elif args.verify:
        print(f"\n--verify checks expert stores; {path} is a model directory (convert it with fate-edge convert)")
        return 2
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from .convert import ConvertOptions, convert

    opts = ConvertOptions(bits=args.bits, group_size=args.group, cold_bits=args.cold_bits,
                          cold_group_size=args.cold_group, keep_bf16=not args.no_bf16, force=args.force,
                          method=args.method, layout=args.layout)
    out = convert(args.model_dir, args.out_dir, opts, progress=not args.quiet)
    print(f"wrote expert store {out}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from .bundled import bundled_model_dir
    from .engine import parse_bytes
    from .planner import auto_plan, plan, record_plan_trace, roofline_layer_time, sample_token_ids
    from .store import ExpertStore
    from .store_cache import ensure_store
    from .tokenizer import Tokenizer

    store_dir = ensure_store(args.model or bundled_model_dir())
    budget = parse_bytes(args.memory_budget)
    tok = Tokenizer(store_dir)
    ids = tok.encode(open(args.corpus, encoding="utf-8").read())[: args.tokens] if args.corpus else \
        sample_token_ids(tok, args.tokens)
    if args.device == "host":
        result = auto_plan(store_dir, budget, token_ids=ids)
    else:
        from fate_edge.devices.link import storage_link
        from fate_edge.devices.profile import load_profile

        from .loader import load_model

        profile = load_profile(args.device)
        model = load_model(store_dir)
        store = ExpertStore(store_dir)
        bits = model.experts.bits
        trace = record_plan_trace(model, ids, store_dir=store_dir)
        resident = sum(t.numel() * t.element_size() for t in model.w.values()) // model.config.num_hidden_layers
        layer_s = roofline_layer_time(model.config, profile, store.expert_bytes(bits), resident)
        result = plan(trace, budget, store.expert_bytes(bits), store.precisions[bits].slot_bytes,
                      storage_link(profile), layer_s)
        model.experts.close()
    print(f"model           {store_dir}")
    print(f"memory budget   {budget / 1e6:.1f} MB for experts, device {args.device}")
    print(result.describe())
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    from fate_edge.devices.probe import default_path, host_profile, to_toml

    profile = host_profile(refresh=True)
    print(to_toml(profile), end="")
    print(f"# saved to {default_path()}; use it as --device host / --link host")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fate-edge", description="Run Mixture-of-Experts models on small devices.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="generate text from a prompt (argument or stdin), streaming to stdout")
    run.add_argument("prompt", nargs="?", default=None, help="prompt text; read from stdin when omitted")
    _add_model_args(run)
    _add_sampling_args(run)
    run.add_argument("--memory-budget", default=None,
                     help="bytes for experts (e.g. 64MB): run from an expert store under this hard limit")
    run.add_argument("--verify", default="once", choices=["once", "always"],
                     help="expert store: check each blob's CRC32 on its first read (default) or on every read")
    run.add_argument("--policy", default=None, help="policy preset: load-on-demand, lru, activation-path, fate, "
                     "fate-edge (default with --memory-budget)")
    run.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    run.add_argument("--echo", action="store_true", help="print the prompt before the continuation")
    run.set_defaults(func=cmd_run)

    ins = sub.add_parser("inspect", help="architecture, parameter counts, expert vs resident bytes")
    ins.add_argument("model_dir", nargs="?", default=None, help="model directory (default: the bundled model)")
    ins.add_argument("--verify", action="store_true",
                     help="expert store: check every blob's CRC32 and report the first corrupted one")
    ins.set_defaults(func=cmd_inspect)

    pl = sub.add_parser("plan", help="choose a policy for a device profile and memory budget (simulated)")
    pl.add_argument("model", nargs="?", default=None, help="model directory or store (default: bundled model)")
    pl.add_argument("--device", default="host", help="device profile name (devices/profiles) or 'host' (measured)")
    pl.add_argument("--memory-budget", required=True, help="bytes for experts, e.g. 4GB")
    pl.add_argument("--corpus", default=None, help="text to record routing on (default: a stdlib module's source)")
    pl.add_argument("--tokens", type=int, default=256)
    pl.set_defaults(func=cmd_plan)

    probe = sub.add_parser("probe", help="measure this machine (memory, compute, storage) as the 'host' profile")
    probe.set_defaults(func=cmd_probe)

    conv = sub.add_parser("convert", help="write an expert store: resident weights + one aligned blob per expert")
    conv.add_argument("model_dir", help="Hugging Face model directory")
    conv.add_argument("out_dir", help="store directory to create (written atomically)")
    conv.add_argument("--bits", type=int, default=4, choices=[8, 4, 3, 2], help="precision of the streamed copy")
    conv.add_argument("--group", type=int, default=64, choices=[32, 64, 128], help="quantization group size")
    conv.add_argument("--cold-bits", type=int, default=None, choices=[4, 3, 2], help="extra low-precision copy")
    conv.add_argument("--cold-group", type=int, default=32, choices=[32, 64, 128])
    conv.add_argument("--method", default="rtn", choices=["rtn", "hqq"],
                      help="quantizer: round-to-nearest (Fate's) or HQQ-style refinement (lower error, slower)")
    conv.add_argument("--layout", default="auto", choices=["auto", "portable", "cpu-int4"],
                      help="streamed copy's blob layout: cpu-int4 is torch's CPU kernel layout (no repacking when "
                      "loaded); portable works on any device (needed for --device cuda)")
    conv.add_argument("--no-bf16", action="store_true", help="do not keep a bf16 copy of the experts")
    conv.add_argument("--force", action="store_true", help="replace an existing store")
    conv.add_argument("--quiet", action="store_true", help="no progress bar")
    conv.set_defaults(func=cmd_convert)

    from .bench_cli import add_bench_parser
    from .calibrate import add_calibrate_parser
    from .chat_cli import add_chat_parser
    from .demo import add_demo_parser
    from .server.main import add_serve_parser

    add_calibrate_parser(sub)
    add_bench_parser(sub)
    add_serve_parser(sub)
    add_chat_parser(sub)
    add_demo_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except FateEdgeError as exc:
        print(f"fate-edge: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into head/less that exited early
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
