"""``fate-edge`` command line: a thin dispatcher over the library (run, inspect, convert, plan, probe, ...).

The commands whose code lives in a concern package (the benchmarks, the synthetic generator, quality evaluation,
the model card, relayout) are dispatched as mlx-lm dispatches its own: COMMANDS names each one's
``module:function``, imported only when that command runs, so ``fate-edge --help`` lists them without importing
them. Each such module has ``main(argv) -> int`` and ``build_parser()``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from fate_edge import defaults
from fate_edge.apps.cli_args import (
    add_sampling_args,
    byte_size,
    emulated_device,
    existing_path,
    positive_int,
    profile_name,
    resident_width,
    use_option_types,
)
from fate_edge.apps.command_line import PROG, CliParser, model_path, model_ref
from fate_edge.apps.engine_args import add_engine_args
from fate_edge.apps.plan_cli import cmd_plan
from fate_edge.errors import FateEdgeError
from fate_edge.format.convert import EMBEDDING_BITS, GROUP_SIZES, RESIDENT_BITS
from fate_edge.sizes import format_bytes
from fate_edge.version import __version__


def _add_model_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p, memory_budget=None, policy=None)
    p.add_argument(
        "--experts",
        default=None,
        choices=["memory", "lazy"],
        help="no engine (no expert cache, budget or policy): memory loads every expert; lazy reads each routed "
        "expert from disk when needed (default: the engine, at --memory-budget auto)",
    )
    p.add_argument(
        "--bits",
        type=int,
        default=None,
        choices=[16, 8, 4, 3, 2],
        help="expert store only: precision to stream (16 = bf16; default: the store's quantized copy)",
    )


def cmd_run(args: argparse.Namespace) -> int:
    from fate_edge.apps.engine_args import EngineOptions, make_link, open_engine
    from fate_edge.bundled import bundled_model_dir
    from fate_edge.runtime.auto_threads import set_load_threads
    from fate_edge.runtime.compute_dtype import resolve_dtype
    from fate_edge.runtime.engine import resolve_device
    from fate_edge.runtime.loader import load_model
    from fate_edge.tokenizer import Tokenizer

    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if args.memory_budget or args.policy or args.experts is None:
        # closed on every path, errors included; the memory account printed before loading
        with open_engine(EngineOptions.from_args(args), account=sys.stderr) as engine:
            _generate(args, engine.model, engine.tokenizer, prompt, engine)
            _print_engine_stats(engine)
        return 0
    from fate_edge.format.gguf_reader import is_gguf
    from fate_edge.format.model_names import locate_model

    set_load_threads(args.threads)
    device = resolve_device(args.device)
    model_dir = locate_model(args.model or bundled_model_dir())
    if is_gguf(model_dir):  # a GGUF runs from the store converted from it (once, into the cache)
        from fate_edge.apps.engine_args import resolve_store

        model_dir = resolve_store(args.model)
    model = load_model(
        model_dir,
        dtype=resolve_dtype(args.dtype, device, model_dir),
        experts=args.experts,
        bits=args.bits,
        link=make_link(args.link),
        device=device,
    )
    _generate(args, model, Tokenizer(model_dir), prompt, None)
    return 0


def _generate(args: argparse.Namespace, model, tokenizer, prompt: str, engine) -> None:
    """Stream the continuation to stdout, then one line of speed and memory to stderr."""
    from fate_edge.runtime.generate import GenerateConfig, stream_from_model
    from fate_edge.runtime.sampling import SamplingParams

    if args.chat:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p, args.repetition_penalty, args.seed)
    # no --max-tokens: until end of text or the context the run reserved (--context-tokens)
    config = GenerateConfig(
        args.max_tokens, sampling, stop=args.stop, ignore_eos=args.ignore_eos, context_limit=args.context_tokens
    )
    last = None
    if args.echo:
        sys.stdout.write(prompt)
    steps = engine.stream(prompt, config) if engine else stream_from_model(model, tokenizer, prompt, config)
    for last in steps:
        sys.stdout.write(last.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if last is not None:
        print(
            f"[{last.prompt_tokens} prompt tokens at {last.prompt_tps:.1f} tok/s, "
            f"{last.generation_tokens} generated at "
            f"{last.generation_tps:.1f} tok/s, finish: {last.finish_reason}, peak RSS "
            f"{format_bytes(last.peak_rss_bytes)}]",
            file=sys.stderr,
        )


def _print_engine_stats(engine) -> None:
    s = engine.stats
    print(
        f"[policy {engine.policy.name}, expert budget {format_bytes(engine.budget)} (cache "
        f"{format_bytes(engine.plan.cache_bytes)}): hit rate {100 * s.hit_rate:.1f}% ({s.hits} cached, "
        f"{s.prefetch_hits} prefetched, {s.misses} demand reads), stall {1e3 * s.stall_s:.0f} ms, read "
        f"{format_bytes(s.demand_bytes + s.prefetch_bytes)} ({format_bytes(s.demand_bytes)} on the critical path), "
        f"wasted {format_bytes(s.wasted_bytes)}, {s.prediction_summary}]",
        file=sys.stderr,
    )
    if engine.load_report.reads or engine.load_report.note:  # Fate: resident first layer, cache filled at load
        print(f"[at load: {engine.load_report.describe()}]", file=sys.stderr)


def cmd_inspect(args: argparse.Namespace) -> int:
    from fate_edge.bundled import bundled_model_dir
    from fate_edge.format.inspect_model import format_store, format_summary, summarize
    from fate_edge.format.store import is_store

    path = args.model_dir or bundled_model_dir()
    from fate_edge.format.gguf_reader import is_gguf

    if is_gguf(path):  # its header only: the per-layer table is the store's, made on first use
        return _inspect_gguf(path)
    print(format_summary(summarize(path)))
    if args.memory_budget is not None:
        from fate_edge.runtime.auto_budget import resolve_budget
        from fate_edge.runtime.compute_dtype import resolve_dtype
        from fate_edge.runtime.memory_account import memory_account

        args.dtype = resolve_dtype(args.dtype, "cpu", path)
        budget = resolve_budget(
            path, args.memory_budget, args.dtype, args.context_tokens, args.resident_bits, args.embedding_bits
        )
        account = memory_account(
            path,
            budget,
            args.dtype,
            args.context_tokens,
            args.resident_bits,
            embedding_bits=args.embedding_bits,
        )
        print(
            f"\nmemory account (expert budget {format_bytes(account.expert_budget)}, {args.dtype}"
            + (f", int{args.resident_bits} resident linears" if args.resident_bits else "")
            + (f", int{args.embedding_bits} embeddings" if args.embedding_bits else "")
            + ")"
        )
        print("\n".join(account.lines()))
    if is_store(path):
        print()
        print(format_store(path))
        if args.verify:
            from fate_edge.format.store import ExpertStore

            t0 = time.perf_counter()
            checked = ExpertStore(path).verify()  # raises CorruptBlobError naming the first bad blob
            print(
                f"verified        every blob's CRC32: {checked / 1e6:.1f} MB in {time.perf_counter() - t0:.1f} s, "
                "all intact"
            )
    elif args.verify:
        print(f"\n--verify checks expert stores; {path} is a model directory (convert it with fate-edge convert)")
        return 2
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from fate_edge.format.model_list import find_models, format_models
    from fate_edge.format.model_names import looked_in

    models = find_models()
    if not models:
        print(f"no models found (looked in {looked_in()}); fetch one with `huggingface-cli download` or `ollama pull`")
        return 0
    print(format_models(models))
    print(f"\n{len(models)} model(s); run one with: {PROG} run --model NAME PROMPT")
    return 0


def _inspect_gguf(path: str | Path) -> int:
    from pathlib import Path

    from fate_edge.format.model_list import ListedModel, describe

    m = describe(ListedModel(str(path), "gguf", Path(path)))
    if m.problem:
        raise FateEdgeError(f"{path}: {m.problem}")
    params = f"{m.params / 1e6:.1f}M" if m.params else "?"
    print(f"model           {path} (GGUF)\narchitecture    {m.architecture}\nparameters      {params}")
    print(f"file size       {format_bytes(m.file_bytes)}")
    print(
        "converted       "
        + (f"yes, store {format_bytes(m.store_bytes)}" if m.store_bytes is not None else "not yet")
        + f" (its layers and memory account: {PROG} inspect STORE, after `{PROG} convert` or a first run)"
    )
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from fate_edge.format.convert import ConvertOptions, convert
    from fate_edge.format.gguf_convert import convert_gguf
    from fate_edge.format.gguf_reader import is_gguf

    gguf = is_gguf(args.model_dir)
    opts = ConvertOptions(
        bits=args.bits if args.bits or gguf else 4,
        group_size=args.group,
        cold_bits=args.cold_bits,
        cold_group_size=args.cold_group,
        keep_bf16=args.keep_bf16,
        force=args.force,
        method=args.method,
        layout=args.layout,
        threads=args.threads,
        resident_bits=args.resident_bits,
        embedding_bits=args.embedding_bits,
        head_bits=args.head_bits,
    )
    out = (convert_gguf if gguf else convert)(args.model_dir, args.out_dir, opts, progress=not args.quiet)
    print(f"wrote expert store {out}")
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    from fate_edge.devices.probe import default_path, host_profile, to_toml

    profile = host_profile(refresh=True)
    print(to_toml(profile), end="")
    print(f"# saved to {default_path()}; use it as --device host / --link host")
    return 0


def _add_run_parser(sub) -> None:
    run = sub.add_parser("run", help="generate text from a prompt (argument or stdin), streaming to stdout")
    run.add_argument("prompt", nargs="?", default=None, help="prompt text; read from stdin when omitted")
    _add_model_args(run)
    add_sampling_args(run)
    run.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    run.add_argument("--echo", action="store_true", help="print the prompt before the continuation")
    run.set_defaults(func=cmd_run)


def _add_convert_parser(sub) -> None:
    conv = sub.add_parser("convert", help="write an expert store: resident weights + one aligned blob per expert")
    conv.add_argument(
        "model_dir",
        type=model_path,
        help="Hugging Face model directory or GGUF file, a Hugging Face id (org/name, org/name:Q4_K_M) or an Ollama "
        "name (name:tag) found in the local caches",
    )
    conv.add_argument("out_dir", help="store directory to create (written atomically)")
    conv.add_argument(
        "--bits",
        type=int,
        default=None,
        choices=[8, 4, 3, 2],
        help="precision of the streamed copy (default 4; a GGUF's q8_0 experts: 8)",
    )
    conv.add_argument(
        "--group",
        type=int,
        default=None,
        choices=GROUP_SIZES,
        help="quantization group size (default: the largest of 128, 64, 32 that divides the expert dimensions)",
    )
    conv.add_argument("--cold-bits", type=int, default=None, choices=[4, 3, 2], help="extra low-precision copy")
    conv.add_argument(
        "--cold-group",
        type=int,
        default=None,
        choices=GROUP_SIZES,
        help="group size of the low-precision copy (default: the smallest of 32, 64, 128 that divides)",
    )
    conv.add_argument(
        "--method",
        default="rtn",
        choices=["rtn", "hqq"],
        help="quantizer: round-to-nearest (Fate's) or HQQ-style refinement (lower error, slower)",
    )
    conv.add_argument(
        "--layout",
        default="auto",
        choices=["auto", "portable", "cpu-int4"],
        help="streamed copy's blob layout: portable (fate-edge's own int4 kernel computes on it "
        "directly) or cpu-int4 (torch's CPU kernel layout); auto: portable where the native kernel is "
        "the default here (AVX512-VNNI or AVX2), else cpu-int4. Either runs on every device (CUDA re-packs "
        "experts for its kernel as they arrive)",
    )
    bf16 = conv.add_mutually_exclusive_group()
    bf16.add_argument(
        "--keep-bf16",
        action="store_true",
        help="also keep a bf16 copy of the experts (what the load-on-demand and full-precision baselines read; "
        "the default policy never does)",
    )
    bf16.add_argument("--no-bf16", action="store_true", help="no bf16 copy of the experts (the default)")
    conv.add_argument(
        "--resident-bits",
        type=resident_width,
        default=RESIDENT_BITS,
        help="quantize attention, dense MLPs, shared experts and lm_head here: 8 (per channel), 4 or none (keep "
        f"the checkpoint's dtype); a load reads them as they are (default {RESIDENT_BITS}; a GGUF's quantized "
        "tensors keep their own width)",
    )
    conv.add_argument(
        "--embedding-bits",
        type=resident_width,
        default=EMBEDDING_BITS,
        help=f"quantize the embedding table here: 8 (per row), 4 (per group) or none (default {EMBEDDING_BITS}: a "
        "run reads its rows from the file and holds none; a table tied to the head takes the head's precision)",
    )
    conv.add_argument(
        "--head-bits",
        type=resident_width,
        default=None,
        help="lm_head's own precision: 8, 4 or none (default: --resident-bits)",
    )
    conv.add_argument("--force", action="store_true", help="replace an existing store")
    conv.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="experts encoded in parallel (default: the CPU count, at most 8)",
    )
    conv.add_argument("--quiet", action="store_true", help="no progress bar")
    conv.set_defaults(func=cmd_convert)


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog=PROG, description="Run Mixture-of-Experts models on small devices.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)  # subparsers are CliParsers too
    _add_run_parser(sub)

    ins = sub.add_parser("inspect", help="architecture, parameter counts, expert vs resident bytes")
    ins.add_argument(
        "model_dir",
        nargs="?",
        default=None,
        type=model_path,
        help="model directory, GGUF, expert store, Hugging Face id or Ollama name (default: the bundled model)",
    )
    ins.add_argument(
        "--verify",
        action="store_true",
        help="expert store: check every blob's CRC32 and report the first corrupted one",
    )
    ins.add_argument(
        "--memory-budget",
        default=None,
        type=byte_size,
        help="also print the predicted peak RSS by part for a run with this expert budget, e.g. 200MB",
    )
    ins.add_argument(
        "--resident-bits",
        type=int,
        default=None,
        choices=[8, 4],
        help="with --memory-budget: the run quantizes its resident linears to int8 or int4",
    )
    ins.add_argument(
        "--embedding-bits",
        type=int,
        default=None,
        choices=[8, 4],
        help="with --memory-budget: the run holds the embedding table in int8 or int4",
    )
    ins.add_argument(
        "--dtype",
        default=defaults.DTYPE,
        choices=["auto", "float32", "bfloat16"],
        help="with --memory-budget: the run's compute dtype",
    )
    ins.add_argument(
        "--context-tokens",
        type=positive_int,
        default=defaults.CONTEXT_TOKENS,
        help=f"with --memory-budget: prompt + answer tokens (default {defaults.CONTEXT_TOKENS})",
    )
    ins.set_defaults(func=cmd_inspect)

    pl = sub.add_parser("plan", help="choose a policy for a device profile and memory budget (simulated)")
    pl.add_argument(
        "model",
        nargs="?",
        default=None,
        type=model_ref,
        help="model directory or expert store (default: bundled model)",
    )
    pl.add_argument(
        "--device",
        default="host",
        type=profile_name,
        help="device profile name (devices/profiles) or 'host' (measured)",
    )
    pl.add_argument("--memory-budget", required=True, type=byte_size, help="bytes for experts, e.g. 4GB")
    pl.add_argument(
        "--corpus",
        default=None,
        type=existing_path,
        help="text to record routing on (default: a stdlib module's source)",
    )
    pl.add_argument("--tokens", type=positive_int, default=256)
    pl.add_argument(
        "--emulate",
        nargs="+",
        default=None,
        metavar="DEVICE",
        type=emulated_device,
        help="plan on each DEVICE's timeline instead: this host's measured costs scaled by 1/k (k = host "
        "/ device compute per token, the device from its profile's roofline) against the device's own "
        "link; DEVICE: orin-nano, orin-nx, agx-orin, rpi5, rtx4060 or a device profile",
    )
    pl.set_defaults(func=cmd_plan)

    lst = sub.add_parser(
        "list", help="the models in the local Hugging Face and Ollama caches, and which fate-edge has converted"
    )
    lst.set_defaults(func=cmd_list)

    probe = sub.add_parser("probe", help="measure this machine (memory, compute, storage) as the 'host' profile")
    probe.set_defaults(func=cmd_probe)
    _add_convert_parser(sub)

    from fate_edge.apps.calibrate_cli import add_calibrate_parser
    from fate_edge.apps.chat import add_chat_parser
    from fate_edge.apps.demo import add_demo_parser
    from fate_edge.apps.server.main import add_serve_parser

    # Parsers written elsewhere get the shared argument types by option name (see cli_args.OPTION_TYPES).
    for add in (add_calibrate_parser, add_serve_parser):
        use_option_types(add(sub))
    add_chat_parser(sub)
    add_demo_parser(sub)
    for name, (_, summary) in COMMANDS.items():  # listed in --help only: main() hands them their arguments
        sub.add_parser(name, help=summary, add_help=False)
    return parser


# Commands that live in their concern package: name -> ("module:function", the line --help shows).
COMMANDS: dict[str, tuple[str, str]] = {
    "bench": (
        "fate_edge_lab.bench.cli:main",
        "benchmark every policy preset, the oracle and peers under memory "
        "budgets on emulated device links (JSON, markdown table, plots)",
    ),
    "bench-llamacpp": (
        "fate_edge_lab.bench.llamacpp_cli:main",
        "fate-edge beside llama.cpp on the same checkpoint, resident and memory-limited, in fresh processes",
    ),
    "bench-scale": (
        "fate_edge_lab.bench.scale_cli:main",
        "a real-size checkpoint: convert it in a memory cgroup, run "
        "it at expert budgets from the raw disk (needs root)",
    ),
    "eval-quality": (
        "fate_edge_lab.bench.quality_cli:main",
        "held-out perplexity and greedy agreement of quantized experts (RTN, HQQ) against bf16",
    ),
    "model-card": (
        "fate_edge_lab.bench.model_card:main",
        "measure a model directory and write its model card (perplexity, expert usage, cross-layer prediction)",
    ),
    "synth": (
        "fate_edge_lab.synthetic.cli:main",
        "write a synthetic checkpoint with a published MoE model's shapes (random weights)",
    ),
    "relayout": (
        "fate_edge.apps.relayout_cli:main",
        "re-lay out an expert store's cpu-int4 experts as portable, without the checkpoint",
    ),
}


LAB = "fate_edge_lab"  # the benchmarks' package: the product never imports it, only dispatches to it


def resolve(spec: str) -> Callable:
    """The function a "module:function" spec names, its module imported now; a lab command without the lab installed
    is one error line naming the extra."""
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        if module.startswith(LAB + ".") and exc.name is not None and exc.name.split(".")[0] == LAB:
            raise FateEdgeError("this command is in the lab, not installed: pip install 'fate-edge[lab]'") from exc
        raise


def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every subcommand's own parser, the dispatched commands' included (imports every command module)."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parsers = dict(sub.choices)
    for name, (spec, _) in COMMANDS.items():
        parsers[name] = importlib.import_module(spec.partition(":")[0]).build_parser()
    return parsers


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:
        run = partial(resolve(COMMANDS[argv[0]][0]), argv[1:])
    else:
        args = build_parser().parse_args(argv)
        run = partial(args.func, args)
    try:
        return run()
    except FateEdgeError as exc:
        print(f"fate-edge: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        from fate_edge.runtime.load_threads import exit_if_loading

        exit_if_loading(130)  # a conversion still running on its own thread: exit now, not abort at exit
        return 130
    except BrokenPipeError:  # output piped into head/less that exited early
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
