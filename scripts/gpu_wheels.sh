#!/usr/bin/env bash
# Wheels for installing fate-edge offline on a CUDA machine whose Python already has torch (a lent GPU machine, a
# Jetson with JetPack's torch, a workstation): the project's own wheel and the runtime dependencies such images
# often lack, for CPython 3.12 on x86-64 Linux (--python-version / --platform to change). They land in .whl/
# (git-ignored), where scripts/gpu_check.sh installs them from; nothing here touches the torch of that machine.
# Usage: bash scripts/gpu_wheels.sh [PYTHON_VERSION] [PLATFORM]
set -euo pipefail
cd "$(dirname "$0")/.."
py="${1:-3.12}"
plat="${2:-manylinux_2_17_x86_64}"
rm -rf .whl && mkdir -p .whl
# Pure-Python and binary wheels of the daemon stack, ISA-L's CRC and what they import (versions as tested here).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    --platform "$plat" --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
    fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 uvicorn==0.55.0 isal==1.9.1 opentelemetry-api importlib-metadata
rm -rf build   # a stale build/lib (say, from before a module moved) would ship its old files in the wheel
python3 -m pip wheel -q --no-deps -w .whl .   # fate-edge itself, from this checkout
ls -1 .whl
