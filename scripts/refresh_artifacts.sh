#!/usr/bin/env bash
# Regenerate everything measured on the bundled model, in dependency order, after (re)training it:
# calibrated predictors, the model card, quantization quality, forward speed vs transformers, and the
# side-by-side benchmark. Each step writes its JSON under bench-out/ (not committed) and its table into
# docs/results/ (one file per table) or the model card. Run on an otherwise idle machine: the timings are real.
set -euo pipefail
cd "$(dirname "$0")/.."
M=fate_edge/assets/tiny-moe
fate-edge calibrate "$M" --predictors-dir "$M/predictors" --lookahead 2 --tokens 440000 --threads 2 --quiet \
    | tee bench-out/calibrate.txt
fate-edge model-card "$M" --tokens 16384
fate-edge eval-quality --tokens 16384 --json bench-out/quality.json --results
python research/bench_forward.py --runs 5 --json bench-out/forward.json --results
fate-edge bench --quick --results --plots-dir docs
