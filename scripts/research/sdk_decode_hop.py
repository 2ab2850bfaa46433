"""SDK decode speed of one request against a baseline checkout, in fresh processes, interleaved rounds (issue 55:
a lone request steps in its reader's thread instead of hopping into the batcher's).

    python scripts/research/sdk_decode_hop.py --base /tmp/s55-base --rounds 5 [--store DIR] [--name NAME]

Each round runs one child process per checkout (alternating which goes first); a child loads the engine as
``Engine.load`` does, warms it, and streams ``--reps`` requests through ``fate_edge.sdk.stream`` (the path
``sdk.generate`` takes), timing decode in the caller's thread: from the first token to the last. Writes
docs/results/sdk_decode_hop-NAME.json and .md.
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

    kw = {} if store is None else {"model": store}
    with Engine.load(**kw) as engine:
        sdk.generate(engine, "def main():", max_tokens=8, ignore_eos=True)  # warm
        rates = []
        for _ in range(reps):
            stamps = [time.perf_counter() for _ in sdk.stream(engine, PROMPT, max_tokens=tokens, ignore_eos=True)]
            rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
        batched = engine.batcher is not None
    print(
        json.dumps(
            {
                "fate_edge": str(Path(fate_edge.__file__).parent.parent),
                "threads": torch.get_num_threads(),
                "batched": batched,
                "tok_s": statistics.median(rates),
                "reps": rates,
            }
        )
    )


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
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.store, args.tokens, args.reps)
        return
    from fate_edge_lab.bench.host import cpu_model, load_average

    head = HERE.parents[2]
    roots = {"base": args.base, "head": head}
    runs: dict[str, list[float]] = {"base": [], "head": []}
    info: dict[str, dict] = {}
    loads = [load_average()]
    for r in range(args.rounds):
        for name in ("base", "head") if r % 2 == 0 else ("head", "base"):
            result = run_child(roots[name], args)
            runs[name].append(result["tok_s"])
            info[name] = {"commit": git_head(roots[name]), "threads": result["threads"], "batched": result["batched"]}
            print(f"round {r + 1} {name}: {result['tok_s']:.1f} tok/s", file=sys.stderr)
        loads.append(load_average())
    med = {k: statistics.median(v) for k, v in runs.items()}
    record = {
        "model": args.store or "bundled",
        "tokens": args.tokens,
        "reps_per_child": args.reps,
        "rounds": args.rounds,
        "tok_s": runs,
        "median_tok_s": med,
        "head_over_base": med["head"] / med["base"],
        "checkouts": info,
        "cpu": cpu_model(),
        "load_average": loads,
    }
    out = head / "docs" / "results" / f"sdk_decode_hop-{args.name}"
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    rows = [
        f"# SDK decode, one request: {args.name}",
        "",
        f"`fate_edge.sdk.stream` (the path of `sdk.generate`), {args.tokens} tokens, decode timed in the caller's "
        f"thread; median of {args.rounds} interleaved rounds, each a fresh process per checkout taking the median "
        f"of {args.reps} requests. {record['cpu']}, torch threads {info['head']['threads']}, load average "
        f"{min(x[0] for x in loads):.1f}-{max(x[0] for x in loads):.1f} (1 min) during the run. Produced by "
        "`scripts/research/sdk_decode_hop.py`.",
        "",
        "| checkout | commit | decode tok/s (median) | rounds |",
        "|---|---|---|---|",
    ]
    for name in ("base", "head"):
        each = ", ".join(f"{x:.0f}" for x in runs[name])
        rows.append(f"| {name} | {info[name]['commit']} | {med[name]:.1f} | {each} |")
    rows += ["", f"head / base: {record['head_over_base']:.3f}", ""]
    out.with_suffix(".md").write_text("\n".join(rows))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
