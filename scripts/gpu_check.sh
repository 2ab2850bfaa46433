#!/usr/bin/env bash
# One prepared check of the CUDA path on a lent GPU machine; finishes in under 8 minutes (timeouts 150 + 90 +
# 230 s), installs nothing beyond the project itself (from the carried venv or wheels).
# Usage: scripts/gpu_check.sh OUT_DIR
set -uo pipefail
out="${1:?usage: scripts/gpu_check.sh OUT_DIR}"
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
{
  echo "== machine"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
  echo "== GPU tests"; timeout 150 python -m pytest -q tests/test_gpu.py tests/test_transfer.py
  echo "== logits parity GPU vs CPU and decode speed"; timeout 90 python scripts/gpu_parity.py --json "$out/parity.json"
  echo "== benchmark (quick, cuda)"; timeout 230 python scripts/bench.py --quick --device cuda --time-limit 150 --json "$out/bench.json"
} 2>&1 | tee "$out/gpu_check.log"
