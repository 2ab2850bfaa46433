"""fate-edge: run Mixture-of-Experts language models on devices smaller than the model."""

import os

# Before torch loads libgomp, which reads this once: idle OpenMP threads sleep instead of spinning, so decode
# degrades gracefully when other processes want the cores (spinning threads took it from ~130 to ~2 tok/s on a
# busy 2-core host; scripts/bench_threads.py). A value the user set wins; torch imported before fate_edge keeps
# libgomp's default.
# The marker (inherited by child processes too) lets peers with an OpenMP runtime of their own (llama.cpp links
# the system libgomp) start without our value: passive waiting made llama.cpp's decode 20x slower
# (fate_edge.bench.llamacpp).
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ["FATE_EDGE_SET_OMP_WAIT_POLICY"] = "1"

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
