"""Build and run the AMX-INT8 probe (``amx_int4_tiles.c`` beside this file) against the int4 kernel's VNNI GEMM.

The probe computes ``x @ W.T`` for a random int4 ``W`` both ways on one thread, with the kernel's exact numbers (it
reports how many outputs differ in their bits), and prints the median time of each over interleaved rounds. This
runs its variants on the Qwen1.5-MoE ``lm_head`` (151936 x 2048, 8 and 16 rows: a batched decode step's head) and
on one expert's gate and up (2816 x 2048, 16 rows): the whole AMX GEMM computed one 64-k chunk at a time, in
three phases per 16-column block, and the phased one with each phase left out, which says where its time goes.

    python research/amx_int4_tiles.py [--rounds 5] [--out results.json]

Exits 3 where the CPU has no AMX-INT8, the kernel no AVX512-VNNI, or Linux does not grant the tile state.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from fate_edge.native_build import CFLAGS, compiler
from fate_edge_lab.bench.throughput_rounds import host_note

PROBE = Path(__file__).with_name("amx_int4_tiles.c")
NO_AMX = 3  # the probe's exit code where the CPU, the kernel's instruction set or Linux rule AMX out
VARIANTS = {  # name: -D flags
    "one chunk at a time": ["PER_CHUNK"],
    "three phases": [],
    "phases, B tiles not unpacked": ["SKIP_B"],
    "phases, no tile ops": ["SKIP_T"],
    "phases, sums not scaled": ["SKIP_E"],
    "phases, only the block transposes": ["SKIP_B", "SKIP_T", "SKIP_E"],
}
SHAPES = [  # (what, N, K, group, x rows)
    ("lm_head", 151936, 2048, 128, 8),
    ("lm_head", 151936, 2048, 128, 16),
    ("expert gate+up", 2816, 2048, 128, 16),
]


def build(cc: str, flags: list[str], out: Path) -> Path:
    cmd = [cc, *CFLAGS, *(f"-D{f}" for f in flags), str(PROBE), "-o", str(out), "-lm"]
    subprocess.run(cmd, check=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    cc = compiler()
    if cc is None:
        sys.exit("no C compiler (cc, gcc or clang, or $CC)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        bins = {name: build(cc, flags, Path(tmp) / f"probe{i}") for i, (name, flags) in enumerate(VARIANTS.items())}
        for what, n, k, g, m in SHAPES:
            for name, exe in bins.items():
                if name.startswith("phases,") and (what, m) != ("lm_head", 8):
                    continue  # where the time goes: one shape is enough
                done = subprocess.run([str(exe), *map(str, (n, k, g, m, a.rounds))], capture_output=True, text=True)
                if done.returncode == NO_AMX:
                    sys.stdout.write(done.stdout)
                    sys.exit(NO_AMX)
                done.check_returncode()
                r = json.loads(done.stdout)
                rows.append({"matrix": what, "shape": [n, k], "group": g, "rows": m, "variant": name, **r})
    print("| matrix, x rows | AMX variant | VNNI ms | AMX ms | AMX / VNNI | outputs with other bits |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['matrix']} {r['shape'][0]} x {r['shape'][1]}, {r['rows']} | {r['variant']} | {r['vnni_ms']:.1f} "
            f"| {r['amx_ms']:.1f} | {r['amx_ms'] / r['vnni_ms']:.2f}x | {r['differing']} of {r['outputs']} |"
        )
    note = host_note()
    print(f"\n{note['cpu']}, load average {note['load_average']}, one thread, {a.rounds} interleaved rounds (medians)")
    if a.out is not None:
        a.out.write_text(json.dumps({"rows": rows, "rounds": a.rounds, "host": note}, indent=1) + "\n")


if __name__ == "__main__":
    main()
