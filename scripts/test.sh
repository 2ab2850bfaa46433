#!/usr/bin/env bash
# Create .venv if needed, install fate-edge with its test extra (CPU torch pinned first), lint, run the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[test]'
ruff check .
python -m pytest -q "$@"
