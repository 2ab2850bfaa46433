"""The command line: ``fate-edge bench ...`` and ``python -m fate_edge.bench`` (which also runs the workers the
benchmark starts: ``--worker``, ``--trace``, ``--peer``)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from fate_edge.bench.config import ALL_PRESETS, LINKS, QUICK_NOTE, BenchConfig, apply_quick
from fate_edge.bench.outputs import check_readme, write_outputs
from fate_edge.bench.peers import peer_main
from fate_edge.bench.publish import add_results_arg, results_file
from fate_edge.bench.report import markdown
from fate_edge.bench.run import run_bench
from fate_edge.bench.worker import trace_main, worker_main
from fate_edge.command_line import (
    command_parser,
    device_name,
    existing_path,
    fraction,
    model_path,
    non_negative_int,
    positive_float,
    positive_int,
)
from fate_edge.planning.device_costs import emulated_device
from fate_edge.runtime.policy import PRESETS


def invoked_command(argv: list[str], run_module: str | None = None) -> str:
    """``argv`` as the user typed it: ``python -m MODULE`` when run with -m, ``python SCRIPT.py`` for a script,
    else the program's own name (a console script on PATH such as ``fate-edge``), then the arguments."""
    if run_module:
        prog = f"python -m {run_module}"
    elif argv[0].endswith(".py"):
        prog = f"python {argv[0]}"
    else:
        prog = Path(argv[0]).name
    return " ".join([prog, *map(shlex.quote, argv[1:])])


def this_command() -> str:
    """The command line of this process (sys.argv, with the program as invoked)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return invoked_command(sys.argv, spec.name.removesuffix(".__main__") if spec is not None else None)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    ap.add_argument(
        "--model",
        default=None,
        type=model_path,
        help="model directory or expert store (default: the bundled model inflated to ~2 MB int4 experts)",
    )
    ap.add_argument(
        "--int4-expert-mb",
        type=positive_float,
        default=d.int4_expert_mb,
        help="size of one int4 expert in the inflated bundled model (without --model)",
    )
    ap.add_argument("--quick", action="store_true", help=QUICK_NOTE.replace("%", "%%"))
    ap.add_argument(
        "--presets",
        nargs="+",
        default=None,
        choices=list(PRESETS),
        metavar="PRESET",
        help=f"default: {' '.join(ALL_PRESETS)}",
    )
    ap.add_argument(
        "--budgets",
        nargs="+",
        type=fraction,
        default=None,
        metavar="FRACTION",
        help="shares of the int4 expert bytes (default 0.2 0.35 0.5 0.75)",
    )
    ap.add_argument(
        "--links", nargs="+", default=None, choices=list(LINKS), metavar="LINK", help=f"default: {' '.join(LINKS)}"
    )
    ap.add_argument(
        "--emulate",
        default=None,
        metavar="DEVICE",
        type=emulated_device,
        help="device-faithful emulation instead of --links: the device's link dilated by k = host / "
        "device compute time per token (device: its profile's roofline), O_DIRECT reads where this "
        "disk is faster than that; reports raw and device-equivalent (raw x k) tok/s. DEVICE: "
        "orin-nano, orin-nx, agx-orin, rpi5, rtx4060 or a device profile",
    )
    ap.add_argument(
        "--emulate-host-ms",
        type=positive_float,
        default=None,
        metavar="MS",
        help="with --emulate: this host's decode compute per token from an earlier calibration (the "
        "JSON's emulation.host_s_per_token x 1000) instead of measuring it",
    )
    ap.add_argument(
        "--resident-bits",
        type=int,
        choices=(8, 4),
        default=None,
        help="quantize fate-edge's resident linears (attention, shared experts, lm_head) to this many "
        "bits, as a W4A16 device decode holds them; under --emulate the device's roofline reads them so "
        "(default: the store's dtype)",
    )
    ap.add_argument("--prompt-tokens", nargs="+", type=positive_int, default=None, help="default 128 512")
    ap.add_argument("--decode-tokens", type=positive_int, default=None, help=f"default {d.decode_tokens}")
    ap.add_argument("--runs", type=positive_int, default=None, help=f"default {d.runs}; medians are reported")
    ap.add_argument("--threads", type=non_negative_int, default=0, help="torch threads (default: all CPUs)")
    ap.add_argument("--fetch-workers", type=positive_int, default=d.fetch_workers)
    ap.add_argument("--device", default="cpu", type=device_name, help="cpu or cuda (experts cached on the GPU)")
    ap.add_argument("--no-peers", action="store_true", help="do not run transformers / llama.cpp")
    ap.add_argument(
        "--gguf", default=None, type=existing_path, help="GGUF of the same checkpoint for the llama.cpp peer"
    )
    ap.add_argument("--no-planner", action="store_true", help="skip the planner hook (planned configurations)")
    ap.add_argument("--no-drop-caches", action="store_true", help="raw disk: keep the page cache")
    ap.add_argument("--timeout", type=positive_float, default=d.timeout_s, help="seconds per configuration")
    ap.add_argument(
        "--time-limit",
        type=positive_float,
        default=None,
        help="seconds for the whole run: later configurations are dropped and listed (quick: 480)",
    )
    ap.add_argument("--out-dir", default=d.out_dir)
    ap.add_argument("--json", default=None, help="default OUT_DIR/bench[_quick].json")
    ap.add_argument("--markdown", default=None, help="default OUT_DIR/bench[_quick].md")
    ap.add_argument("--plot", default=None, help="tokens/s plot file (default: PLOTS_DIR/bench[_quick].png)")
    ap.add_argument("--plots-dir", default=None, help="directory for the plots (default: the JSON's directory)")
    add_results_arg(
        ap,
        f"rewrite the table between the bench markers of FILE (without FILE: {results_file('bench')})",
        dest="readme",
        const=str(results_file("bench")),
    )
    ap.add_argument("--work-dir", default=None, help="where the inflated model and its store are kept")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    cfg = BenchConfig(
        model=args.model,
        int4_expert_mb=args.int4_expert_mb,
        threads=args.threads,
        fetch_workers=args.fetch_workers,
        peers=not args.no_peers,
        gguf=args.gguf,
        planner=not args.no_planner,
        drop_caches=not args.no_drop_caches,
        timeout_s=args.timeout,
        out_dir=args.out_dir,
        json_path=args.json,
        md_path=args.markdown,
        plot_path=args.plot,
        plots_dir=args.plots_dir,
        readme=args.readme,
        work_dir=args.work_dir,
        device=args.device,
        emulate=args.emulate,
        emulate_host_ms=args.emulate_host_ms,
        resident_bits=args.resident_bits,
    )
    explicit = set()
    for name, attr in [
        ("presets", "presets"),
        ("budgets", "budgets"),
        ("links", "links"),
        ("prompt_tokens", "prompt_tokens"),
        ("decode_tokens", "decode_tokens"),
        ("runs", "runs"),
        ("time_limit_s", "time_limit"),
    ]:
        v = getattr(args, attr)
        if v is not None:
            setattr(cfg, name, v)
            explicit.add(name)
    if args.quick:
        apply_quick(cfg, explicit)
    return cfg


def run_from_args(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    cfg.command = this_command()
    if cfg.emulate:  # fail now, not after preparing the model
        from fate_edge.planning.emulation import resolve_device

        resolve_device(cfg.emulate)
    if cfg.readme:  # fail now, not after the run
        check_readme(Path(cfg.readme))
    result = run_bench(cfg)
    paths = write_outputs(result, cfg)
    print(markdown(result))
    print(f"bench: done in {result['wall_s']:.0f}s; wrote " + ", ".join(str(p) for p in paths.values()), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("--worker", "--trace", "--peer"):
        return {"--worker": worker_main, "--trace": trace_main, "--peer": peer_main}[argv[0]](argv[1])
    return run_from_args(build_parser().parse_args(argv))


def build_parser() -> argparse.ArgumentParser:
    ap = command_parser("bench", sys.modules[__package__].__doc__)
    add_arguments(ap)
    return ap
