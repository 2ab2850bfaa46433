#!/usr/bin/env bash
# One prepared check of the CUDA path on a bare CUDA machine that has torch and no network; under 8 minutes on a
# 16-core H200 machine. It installs fate-edge into a private folder from this checkout and the wheels in .whl/
# (made beforehand by scripts/gpu_wheels.sh on a machine with the package index), keeping that machine's torch.
# Then: the GPU tests, logits GPU vs CPU on the bundled model, and the real-shape benchmark (a synthetic
# Qwen1.5-MoE-A2.7B slice: generate, convert with the defaults, fate-edge resident and at two budgets, fate,
# load-on-demand-int4, transformers resident and accelerate-offloaded), with torch.profiler's view of where a
# token's time goes; then the throughput mode (8 concurrent requests against one at a time) on the slice. The budgeted
# rows run with the pinned host tier (its default on a discrete GPU), the fate-edge preset at the first budget also
# without it and with misses computed on the CPU (hybrid); gpu_bench.md splits their figures into prompt and decode.
# Then issue 59's one graph per token under the first budget against the per-layer graphs, and resident prefill
# with the grouped Triton kernels against the eager one, and the same at the first budget over staged blobs
# (scripts/gpu_slot_prefill.py, a portable store of the slice).
# Writes OUT_DIR/gpu_check.log, parity.json, gpu_bench.json, gpu_bench.md, profile-*.txt, slot_prefill.json,
# throughput.json.
# Usage: scripts/gpu_check.sh OUT_DIR      (LAYERS=8 PEERS=1 BUDGETS="1GB 0.5GB" to change the benchmark)
set -uo pipefail
out="${1:?usage: scripts/gpu_check.sh OUT_DIR}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
layers="${LAYERS:-8}"
budgets="${BUDGETS:-1GB 0.5GB}"
work="${WORK:-/tmp/fate-edge-gpu}"
site="$work/site"
py=python3
{
  echo "== machine"; date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
  echo "== install (offline, into $site; the machine's torch is kept)"
  rm -rf "$site" && mkdir -p "$site"
  deps=$(ls .whl/*.whl 2>/dev/null | grep -v '/fate_edge-')
  [ -n "$deps" ] && $py -m pip install -q --no-index --no-deps --no-compile --target "$site" $deps
  if ! $py -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$site" . 2>"$work.err"; then
    echo "building from the checkout failed ($(tail -1 "$work.err")); installing .whl/fate_edge-*.whl instead"
    $py -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/fate_edge-*.whl || exit 1
  fi
  export PYTHONPATH="$site"
  # -P: never import the source tree from the current directory (its side folders install under fate_edge.*)
  $py -P -c "import fate_edge, fastapi, isal; print('fate-edge', fate_edge.__version__, 'from', fate_edge.__file__)" || exit 1
  echo "== GPU tests"; timeout 300 $py -P -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_transfer.py tests/test_triton_moe.py tests/test_staging_release.py \
    tests/test_slot_step.py tests/test_slot_step_in_place.py::test_the_captured_in_place_slot_step_on_cuda_gives_the_layer_graphs_tokens \
    tests/test_grouped_prefill.py \
    tests/test_gpu_tiers.py tests/test_host_tier.py tests/test_cpu_miss.py tests/test_land_early.py
  echo "== logits parity GPU vs CPU and decode speed (bundled model)"
  timeout 90 $py -P scripts/gpu_parity.py --json "$out/parity.json"
  echo "== real-shape slice: qwen1.5-moe-a2.7b, $layers layers"
  rm -rf "$work/model" "$work/store"
  timeout 120 $py -P -m fate_edge synth --like qwen1.5-moe-a2.7b --layers "$layers" --threads 16 "$work/model"
  timeout 120 $py -P -m fate_edge convert "$work/model" "$work/store" --bits 4 --no-bf16
  peers=(); [ "${PEERS:-1}" = 1 ] || peers=(--no-peers)
  timeout 300 $py -P scripts/gpu_bench.py --model "$work/model" --store "$work/store" --budgets $budgets \
    "${peers[@]}" --json "$out/gpu_bench.json" --markdown "$out/gpu_bench.md" --profile-dir "$out"
  echo "== issue 59 items 4-5: one graph per token at $(echo $budgets | cut -d' ' -f1) (slots vs per-layer graphs), grouped prefill"
  rm -rf "$work/store-portable"
  timeout 120 $py -P -m fate_edge convert "$work/model" "$work/store-portable" --bits 4 --no-bf16 --layout portable
  timeout 300 $py -P scripts/gpu_slot_prefill.py --store "$work/store" --portable-store "$work/store-portable" \
    --budget "$(echo $budgets | cut -d' ' -f1)" --json "$out/slot_prefill.json"
  echo "== throughput: 8 concurrent requests against one at a time (the slice, 35% budget; issue 38's GPU row)"
  timeout 150 $py -P -m fate_edge_lab.bench.throughput --device cuda --model "$work/store" --dtype bfloat16 \
    --concurrency 8 --max-tokens 32 --rounds 3 --out "$out/throughput.json"
  echo "== done"; date -u
} 2>&1 | tee "$out/gpu_check.log"
