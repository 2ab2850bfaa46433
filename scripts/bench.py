"""The side-by-side benchmark: baselines, ours, the oracle bound and peers, in one run (see fate_edge.bench).

    python scripts/bench.py --quick --results --plots-dir docs   # docs/results/bench.md and the plots in docs/
    python scripts/bench.py                                               # everything: 4 links, 4 budgets, 3 runs
    python scripts/bench.py --help

The same benchmark is ``fate-edge bench``; this script only runs ``fate_edge.bench.main`` (install the package
first, ``pip install -e .``: the benchmark's worker processes import it).
"""

from __future__ import annotations

import sys

from fate_edge.bench import main

if __name__ == "__main__":
    sys.exit(main())
