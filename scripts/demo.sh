#!/usr/bin/env bash
# Create .venv if needed, install fate-edge (CPU torch pinned first) and run `fate-edge demo` on the bundled model.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
pip_install --resume-retries 20 -e .
fate-edge inspect
fate-edge demo    # bundled model under a tight expert budget: fate-edge vs load-on-demand, then a summary
