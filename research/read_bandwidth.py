"""The memory's read floor at 1..N threads (``read_bandwidth.c``: AVX-512 loads over 1 GB on huge pages, best of 7
passes), repeated ``--repeats`` times in fresh processes: on a VM whose vCPUs may or may not share a physical core
the two-thread figure moves between runs, so every run is printed with the load average.

    python research/read_bandwidth.py --threads 2 --repeats 6
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

from fate_edge.native_build import CFLAGS, compiler
from fate_edge_lab.bench.host import cpu_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cc = compiler()
    if cc is None:
        raise SystemExit("no C compiler (set CC)")
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "read_bandwidth"
        src = Path(__file__).with_suffix(".c")
        subprocess.run([cc, *CFLAGS, str(src), "-o", str(exe)], check=True)
        print(json.dumps({"cpu": cpu_model()}))
        for _ in range(args.repeats):
            out = subprocess.run([str(exe), str(args.threads)], capture_output=True, text=True, check=True).stdout
            for line in out.splitlines():
                row = json.loads(line)
                row.pop("sink")
                row["load_average"] = round(os.getloadavg()[0], 2)
                print(json.dumps(row))


if __name__ == "__main__":
    main()
