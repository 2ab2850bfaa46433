"""Interleaved A/B of fully resident int4 decode and prefill across checkouts or settings, fresh processes.

Each variant is a source tree (put first on PYTHONPATH, so a copy of another commit runs beside this one; a copy
needs the setuptools package-dir folders linked into its fate_edge/, e.g. ``ln -s ../quant fate_edge/quant``), an
optional kernel cache of its own and optional environment settings. Each process runs `fate-edge bench-llamacpp`'s
"fate-edge int4, int4 rest" side (``fate_edge_lab.bench.sidebyside.child_main``: bf16 activations, every expert
int4 in memory, attention, shared experts and lm_head int4) on a store; rounds interleave every variant, model and
thread count (the order of the variants alternating), and the 1-minute load average is recorded beside each run.

    python research/ab_resident.py --store q2l=/tmp/q2l-store:/data/q2l --threads 1 2 --rounds 3 \\
        --variant base=/tmp/base:/tmp/base-cache --variant new=. --variant spin=.::GOMP_SPINCOUNT=100000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fate_edge import running_elsewhere


def parse_variant(text: str) -> tuple[str, str, str, dict[str, str]]:
    """``name=tree[:cache[:K=V,K=V]]`` → (name, tree, cache or "", env)."""
    name, rest = text.split("=", 1)
    parts = rest.split(":", 2)
    tree, cache = parts[0], parts[1] if len(parts) > 1 else ""
    env = dict(kv.split("=", 1) for kv in parts[2].split(",") if kv) if len(parts) > 2 else {}
    return name, tree, cache, env


def run_one(tree: str, cache: str, env_extra: dict[str, str], spec: dict, folder: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.pop("FATE_EDGE_SET_OPENMP", None)
    env["PYTHONPATH"] = str(Path(tree).resolve())
    if cache:
        env["FATE_EDGE_CACHE"] = cache
    env.update(env_extra)
    path = Path(folder) / f"spec-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(spec))
    code = "import sys; from fate_edge_lab.bench.sidebyside import child_main; child_main(open(sys.argv[1]).read())"
    load = os.getloadavg()[0]
    running = running_elsewhere()  # what fate_edge's import will see (the host's other tasks, this one's not)
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True, timeout=900, cwd=tree
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": done.stderr.strip()[-600:], "load_avg": load, "running_elsewhere": running}
    out = json.loads(lines[-1])
    out["load_avg"], out["running_elsewhere"] = load, running
    out["load_avg_after"] = os.getloadavg()[0]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", action="append", required=True, help="name=STORE:MODEL_DIR (the tokenizer's folder)")
    ap.add_argument("--variant", action="append", required=True, help="name=TREE[:CACHE[:K=V,...]]")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    variants = [parse_variant(v) for v in args.variant]
    stores = []
    for s in args.store:
        name, rest = s.split("=", 1)
        store, model = rest.split(":", 1)
        stores.append((name, store, model))
    ids = [(7919 * i + 13) % 8000 + 100 for i in range(args.prompt_tokens)]
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for r in range(args.rounds):
            order = variants if r % 2 == 0 else variants[::-1]
            for sname, store, model in stores:
                for threads in args.threads:
                    for vname, tree, cache, env in order:
                        spec = {
                            "kind": "fate-edge",
                            "precision": "int4",
                            "mode": "resident",
                            "store": store,
                            "model": model,
                            "threads": threads,
                            "decode_tokens": args.decode_tokens,
                            "ids": ids,
                            "dtype": "bf16",
                            "resident_bits": 4,
                        }
                        out = run_one(tree, cache, env, spec, folder)
                        key = f"{sname} {threads}t {vname}"
                        runs.setdefault(key, []).append(out)
                        print(
                            f"round {r} {key}: prefill {out.get('prefill_tps', 0):.1f} decode "
                            f"{out.get('decode_tps') or 0:.2f} tok/s (cpu {out.get('decode_cpu_tps') or 0:.2f}) "
                            f"load {out['load_avg']:.2f} running {out['running_elsewhere']}"
                            + (" ERROR " + out["error"] if "error" in out else ""),
                            flush=True,
                        )
    summary = {}
    for key, rs in runs.items():
        ok = [x for x in rs if "error" not in x]
        summary[key] = {
            k: statistics.median(x[k] for x in ok) if ok else None
            for k in ("prefill_tps", "decode_tps", "decode_cpu_tps", "load_avg")
        }
        summary[key]["loads"] = [round(x["load_avg"], 2) for x in rs]
        summary[key]["running_elsewhere"] = [x["running_elsewhere"] for x in rs]
        summary[key]["decode_all"] = [round(x.get("decode_tps") or 0, 2) for x in rs]
        summary[key]["tokens"] = ok[0]["tokens"][:8] if ok else None
    for key, row in summary.items():
        print(key, json.dumps(row))
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
