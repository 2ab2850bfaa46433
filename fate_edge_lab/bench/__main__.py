"""``python -m fate_edge_lab.bench``: the benchmark's command line, and the entry point of its worker processes."""

import sys

from fate_edge_lab.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
