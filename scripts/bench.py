"""The side-by-side benchmark: baselines, ours, the oracle bound and peers, in one run (see fate_edge/bench.py).

    python scripts/bench.py --quick --readme README.md     # the README "Performance" table and plots
    python scripts/bench.py                                # everything: 4 links, 4 budgets, 3 runs
    python scripts/bench.py --help

The same benchmark is ``fate-edge bench`` once installed; this script only runs ``fate_edge.bench.main``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a source checkout without `pip install -e .`

from fate_edge.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
