#!/usr/bin/env bash
# Create .venv if needed, install fate-edge with its test extra (CPU torch pinned first), lint, type-check, run the
# suite.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
pip_install --resume-retries 20 -e '.[test]'
ruff check .
ruff format --check .
mypy  # the packages and settings in pyproject.toml's [tool.mypy]
python -m pytest -q "$@"
