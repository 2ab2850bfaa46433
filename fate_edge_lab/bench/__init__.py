"""The side-by-side benchmark (docs/architecture.md §8): every baseline preset and ours, in one run, as ratios.

For each emulated link (device profiles' storage or host link, plus the raw disk), each preset and each
memory budget (a share of the int4 expert bytes), one fresh subprocess runs the same requests ``--runs``
times on a cold engine and reports medians: prefill tokens/s per prompt length, decode tokens/s, stall
time and bytes read per decode token, hit rate (cache + timely prefetch), prediction exact match, a
per-layer hit breakdown, and the process's peak RSS (VmHWM, so it is per configuration). Ratios to
load-on-demand (bf16 and int4), to ``fate`` and to the ``oracle`` come from the same run. Peers
(transformers + accelerate disk offload, llama.cpp through llama-cpp-python) run beside them when
installed. Outputs: JSON, a markdown table (optionally spliced into docs/results/bench.md) and PNG plots, next to the
JSON unless ``--plots-dir`` says where.

``--emulate DEVICE`` (fate_edge/planning/emulation.py) replaces the links with one device-faithful emulation: the
device's link dilated by k = this host's decode compute per token / the device's (its profile's roofline),
O_DIRECT reads where this disk outpaces the dilated link; every figure is then reported raw (this host) and
device-equivalent (raw x k), in separate columns and tables.

    fate-edge bench --quick --results --plots-dir docs   # or: python -m fate_edge_lab.bench ...

Model: by default the bundled model inflated to realistic expert sizes (``fate_edge_lab.synthetic.inflate``, ~2 MB per
int4 expert) and converted once into a store with int4, int2 (cold) and bf16 copies, kept under the
fate-edge cache directory; ``--model`` takes another model directory or store.

Modules: ``config`` (presets, links, quick mode), ``prepare`` (model, store, prompts, page cache), ``worker``
(the per-configuration processes), ``peers``, ``run`` (the run in phases), ``results`` (medians and ratios),
``report``, ``plots`` and ``outputs`` (markdown, plots, docs/results), ``cli``. The other measuring commands:
``llamacpp_cli`` (``fate-edge bench-llamacpp``, over ``sidebyside`` and ``gguf``), ``scale_cli``
(``fate-edge bench-scale``, over ``scale``), ``quality`` (``fate-edge eval-quality``) and ``model_card``
(``fate-edge model-card``).
"""

from fate_edge_lab.bench.cli import add_arguments, config_from_args, main, run_from_args
from fate_edge_lab.bench.config import ALL_BUDGETS, ALL_PRESETS, LINKS, BenchConfig
from fate_edge_lab.bench.outputs import write_outputs
from fate_edge_lab.bench.run import run_bench

__all__ = [
    "ALL_BUDGETS",
    "ALL_PRESETS",
    "LINKS",
    "BenchConfig",
    "add_arguments",
    "config_from_args",
    "main",
    "run_bench",
    "run_from_args",
    "write_outputs",
]
