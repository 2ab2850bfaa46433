"""fate-edge: run Mixture-of-Experts language models on devices smaller than the model."""

import os

# Before torch loads libgomp, which reads these once: idle OpenMP threads spin for a short while (GOMP_SPINCOUNT
# 10000, ~0.1 ms), then sleep. libgomp's default spin (~3 ms) turns every busy neighbour into a stall (decode fell
# from ~130 to ~2 tok/s on a busy 2-core host), while sleeping at once (OMP_WAIT_POLICY=PASSIVE) wakes a thread for
# each of the ~300 small operators of a decode token (2 threads, quiet host: PASSIVE 71 tok/s, default spin 266,
# 10000 spins 254; with 2 busy processes 37 / 47 / 46; scripts/bench_threads.py). A wait policy or spin count the
# user set wins (libgomp: GOMP_SPINCOUNT overrides the policy's spin); torch imported before fate_edge keeps
# libgomp's default. FATE_EDGE_SET_OPENMP names what we set (inherited by child processes), so peers with an
# OpenMP runtime of their own (llama.cpp links the system libgomp) start without it (fate_edge.bench.llamacpp).
OPENMP_DEFAULTS = {"GOMP_SPINCOUNT": "10000"}
for _name in filter(None, os.environ.pop("FATE_EDGE_SET_OPENMP", "").split(",")):  # a parent's, not the user's
    os.environ.pop(_name, None)
if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ):
    os.environ.update(OPENMP_DEFAULTS)
    os.environ["FATE_EDGE_SET_OPENMP"] = ",".join(OPENMP_DEFAULTS)

from .bundled import bundled_model_dir
from .engine import Completion, Engine
from .errors import BudgetError, FateEdgeError, GenerationError, ModelFormatError
from .generate import GenerateConfig, GenerationResponse, generate, stream_generate
from .loader import load_model
from .sampling import SamplingParams
from .tokenizer import Tokenizer

__version__ = "0.1.0"

__all__ = [
    "BudgetError",
    "Completion",
    "Engine",
    "FateEdgeError",
    "GenerateConfig",
    "GenerationError",
    "GenerationResponse",
    "ModelFormatError",
    "SamplingParams",
    "Tokenizer",
    "bundled_model_dir",
    "generate",
    "load_model",
    "stream_generate",
]
