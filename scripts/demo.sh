#!/usr/bin/env bash
# Create .venv if needed, install fate-edge (CPU torch pinned first) and run `fate-edge demo` on the bundled model.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q -e .
fate-edge inspect
fate-edge demo    # bundled model under a tight expert budget: fate-edge vs load-on-demand, then a summary
