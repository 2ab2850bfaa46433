"""SDK decode speed of one request against a baseline checkout, in fresh processes, interleaved rounds (issue 55:
a lone request steps in its reader's thread instead of hopping into the batcher's).

    python research/sdk_decode_hop.py --base /tmp/s55-base --rounds 5 [--store DIR] [--name NAME]
    python research/sdk_decode_hop.py --paired --rounds 12 [--store DIR] [--name NAME]

Each round runs one child process per checkout (alternating which goes first); a child loads the engine as
``Engine.load`` does, warms it, and runs ``--reps`` requests through ``fate_edge.sdk.generate``: tokens over the call's
wall time in the caller's thread (a 7-token prompt, so nearly all of it decode; timing from the first streamed token
instead would flatter a worker thread that runs ahead of its reader). ``generation_tps``, the engine's own decode rate
measured where the steps run, and the process's CPU time per token (all threads: what the work costs, whatever share of
a loaded host's cores the process got) are kept beside it. Writes docs/results/sdk_decode_hop-NAME.json and .md.

``--paired`` isolates the hop in one process of this checkout: two engines on the same store, one stepping a lone
request in its reader's thread (as now), one whose worker thread was started up front (every step on it, as before),
requests alternating between them; the medians and the median of each pair's ratio go to
docs/results/sdk_decode_hop-paired-NAME.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
PROMPT = "import os\nimport sys\n"


def child(store: str | None, tokens: int, reps: int) -> None:
    import torch

    import fate_edge
    from fate_edge import Engine, sdk

    with Engine.load(store) as engine:
        sdk.generate(engine, "def main():", max_tokens=8, ignore_eos=True)  # warm
        rates, inside, cpu = [], [], []
        for _ in range(reps):
            c0, t0 = time.process_time(), time.perf_counter()
            done = sdk.generate(engine, PROMPT, max_tokens=tokens, ignore_eos=True)
            rates.append(done.completion_tokens / (time.perf_counter() - t0))
            cpu.append((time.process_time() - c0) / done.completion_tokens * 1e3)
            inside.append(done.generation_tps)
        batched = engine.batcher is not None
    print(
        json.dumps(
            {
                "fate_edge": str(Path(fate_edge.__file__).parent.parent),
                "threads": torch.get_num_threads(),
                "batched": batched,
                "tok_s": statistics.median(rates),
                "reps": rates,
                "generation_tps": statistics.median(inside),
                "cpu_ms_per_token": statistics.median(cpu),
            }
        )
    )


def paired(args: argparse.Namespace, head: Path) -> None:
    """Reader-stepped against worker-stepped, alternating requests in one process (see the module's docstring)."""
    from fate_edge import Engine, sdk
    from fate_edge_lab.bench.host import cpu_model, load_average

    loads = [load_average()]
    rates: dict[str, list[float]] = {"reader": [], "worker": []}
    with Engine.load(args.store) as reader, Engine.load(args.store) as worker:
        assert reader.batcher is not None and worker.batcher is not None
        with worker.batcher._cv:
            worker.batcher._start_worker()
        for engine in (reader, worker):
            sdk.generate(engine, "def main():", max_tokens=8, ignore_eos=True)  # warm
        for r in range(args.rounds):
            for name in ("reader", "worker") if r % 2 == 0 else ("worker", "reader"):
                engine = reader if name == "reader" else worker
                t0 = time.perf_counter()
                done = sdk.generate(engine, PROMPT, max_tokens=args.tokens, ignore_eos=True)
                rates[name].append(done.completion_tokens / (time.perf_counter() - t0))
            loads.append(load_average())
        assert reader.batcher._thread is None  # every reader-stepped request ran in this thread
    med = {k: statistics.median(v) for k, v in rates.items()}
    ratio = statistics.median(a / b for a, b in zip(rates["reader"], rates["worker"]))
    record = {
        "model": args.store or "bundled",
        "tokens": args.tokens,
        "rounds": args.rounds,
        "commit": git_head(head),
        "tok_s": rates,
        "median_tok_s": med,
        "median_pair_ratio_reader_over_worker": ratio,
        "cpu": cpu_model(),
        "load_average": loads,
    }
    out = head / "docs" / "results" / f"sdk_decode_hop-paired-{args.name}"
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    rows = [
        f"# SDK decode, one request, stepped by its reader or by the worker: {args.name}",
        "",
        f"One process at {record['commit']}, two engines on the same store; `fate_edge.sdk.generate`, {args.tokens} "
        f"tokens after a 7-token prompt, tokens / the call's wall time, {args.rounds} requests each, alternating. "
        f"{record['cpu']}, load average {min(x[0] for x in loads):.1f}-{max(x[0] for x in loads):.1f} (1 min). "
        "Produced by `research/sdk_decode_hop.py --paired`.",
        "",
        "| stepped by | sdk.generate tok/s (median) | each request |",
        "|---|---|---|",
    ]
    for name, label in (("worker", "the worker thread (the hop, as before)"), ("reader", "the reader's thread (now)")):
        rows.append(f"| {label} | {med[name]:.1f} | {', '.join(f'{x:.0f}' for x in rates[name])} |")
    rows += ["", f"median of the pairs' reader / worker ratios: {ratio:.3f}"]
    write_table(out, rows)
    print(json.dumps(record))


def write_table(out: Path, rows: list[str]) -> None:
    """docs/results/NAME.md: the title and how it was made, then the table between NAME's markers (as
    ``fate_edge_lab.bench.publish`` writes them)."""
    begin, end = f"<!-- {out.name}:begin -->", f"<!-- {out.name}:end -->"
    cut = rows.index("")  # the title, a blank line, the description, a blank line, the table
    head, body = rows[: cut + 2], rows[cut + 3 :]
    out.with_suffix(".md").write_text("\n".join([*head, "", begin, *body, end, ""]))


def run_child(root: Path, args: argparse.Namespace) -> dict:
    env = dict(os.environ, PYTHONPATH=str(root))
    cmd = [sys.executable, str(HERE), "--child", "--tokens", str(args.tokens), "--reps", str(args.reps)]
    if args.store:
        cmd += ["--store", args.store]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True, cwd=root)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if Path(result["fate_edge"]).resolve() != root.resolve():
        raise SystemExit(f"the child imported fate_edge from {result['fate_edge']}, not {root}")
    return result


def git_head(root: Path) -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
    ).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, help="a checkout of the baseline commit (git worktree add DIR main)")
    ap.add_argument("--store", default=None, help="model or store (default: the bundled model)")
    ap.add_argument("--name", default="bundled", help="the results' file name suffix")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--paired", action="store_true", help="reader- against worker-stepped in one process")
    ap.add_argument("--head", type=Path, default=HERE.parents[1], help="the checkout measured (default: this one)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.store, args.tokens, args.reps)
        return
    head = args.head
    if args.paired:
        paired(args, head)
        return
    from fate_edge_lab.bench.host import cpu_model, load_average

    roots = {"base": args.base, "head": head}
    runs: dict[str, list[float]] = {"base": [], "head": []}
    inside: dict[str, list[float]] = {"base": [], "head": []}
    cpu: dict[str, list[float]] = {"base": [], "head": []}
    info: dict[str, dict] = {}
    loads = [load_average()]
    for r in range(args.rounds):
        for name in ("base", "head") if r % 2 == 0 else ("head", "base"):
            result = run_child(roots[name], args)
            runs[name].append(result["tok_s"])
            inside[name].append(result["generation_tps"])
            cpu[name].append(result["cpu_ms_per_token"])
            info[name] = {"commit": git_head(roots[name]), "threads": result["threads"], "batched": result["batched"]}
            print(f"round {r + 1} {name}: {result['tok_s']:.1f} tok/s", file=sys.stderr)
        loads.append(load_average())
    med = {k: statistics.median(v) for k, v in runs.items()}
    med_inside = {k: statistics.median(v) for k, v in inside.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    pair = statistics.median(h / b for h, b in zip(runs["head"], runs["base"]))
    record = {
        "model": args.store or "bundled",
        "tokens": args.tokens,
        "reps_per_child": args.reps,
        "rounds": args.rounds,
        "tok_s": runs,
        "median_tok_s": med,
        "generation_tps": inside,
        "median_generation_tps": med_inside,
        "cpu_ms_per_token": cpu,
        "median_cpu_ms_per_token": med_cpu,
        "head_over_base": med["head"] / med["base"],
        "median_round_ratio_head_over_base": pair,
        "checkouts": info,
        "cpu": cpu_model(),
        "load_average": loads,
    }
    out = head / "docs" / "results" / f"sdk_decode_hop-{args.name}"
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    rows = [
        f"# SDK decode, one request: {args.name}",
        "",
        f"`fate_edge.sdk.generate`, {args.tokens} tokens after a 7-token prompt, timed in the caller's thread "
        f"(tokens / the call's wall time); median of {args.rounds} interleaved rounds, each a fresh process per "
        "checkout taking the median "
        f"of {args.reps} requests. {record['cpu']}, torch threads {info['head']['threads']}, load average "
        f"{min(x[0] for x in loads):.1f}-{max(x[0] for x in loads):.1f} (1 min) during the run. Produced by "
        "`research/sdk_decode_hop.py`.",
        "",
        "| checkout | commit | sdk.generate tok/s (median) | each round | engine's generation_tps (median) "
        "| process CPU ms per token (median) |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("base", "head"):
        each = ", ".join(f"{x:.0f}" for x in runs[name])
        rows.append(
            f"| {name} | {info[name]['commit']} | {med[name]:.1f} | {each} | {med_inside[name]:.1f} "
            f"| {med_cpu[name]:.2f} |"
        )
    rows += ["", f"head / base: {record['head_over_base']:.3f} (medians); median of the rounds' ratios {pair:.3f}"]
    write_table(out, rows)
    print(json.dumps(record))


if __name__ == "__main__":
    main()
