"""fate-edge: run Mixture-of-Experts language models on devices smaller than the model."""

import os


def openmp_defaults(load: float, cores: int) -> dict[str, str]:
    """How idle OpenMP threads should wait, chosen from the host's load when fate_edge is imported.

    Decode runs ~300 small operators a token, so waiting threads either spin (and steal the core from whoever
    they wait for when the host is busy) or sleep (and are woken for every operator): a short spin while the host
    has a core per running task, passive waiting once it is oversubscribed. The measurements behind this:
    docs/performance.md, "Threads under load".
    """
    return {"GOMP_SPINCOUNT": "10000"} if load < cores else {"OMP_WAIT_POLICY": "PASSIVE"}


# Before torch loads libgomp, which reads these once. A wait policy or spin count the user set wins (libgomp lets
# GOMP_SPINCOUNT override the policy's spin, so we never add one to a user's policy); torch imported before
# fate_edge keeps libgomp's default. FATE_EDGE_SET_OPENMP names what we set (inherited by child processes, which
# choose again), so peers with an OpenMP runtime of their own (llama.cpp links the system libgomp) start without
# it (fate_edge_lab.bench.llamacpp).
for _name in filter(None, os.environ.pop("FATE_EDGE_SET_OPENMP", "").split(",")):  # a parent's, not the user's
    os.environ.pop(_name, None)
if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ):
    _chosen = openmp_defaults(
        os.getloadavg()[0], len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    os.environ.update(_chosen)
    os.environ["FATE_EDGE_SET_OPENMP"] = ",".join(_chosen)

from fate_edge.bundled import bundled_model_dir
from fate_edge.errors import BudgetError, FateEdgeError, GenerationError, ModelFormatError
from fate_edge.planning.auto import plan_engine
from fate_edge.runtime.engine import Completion, Engine
from fate_edge.runtime.engine_config import EngineConfig, set_planner
from fate_edge.runtime.generate import GenerateConfig, GenerationResponse, generate_from_model, stream_from_model
from fate_edge.runtime.loader import load_model
from fate_edge.runtime.sampling import SamplingParams
from fate_edge.tokenizer import Tokenizer
from fate_edge.version import __version__

set_planner(plan_engine)  # policy="auto": the planner, a layer above the runtime, picks in Engine.load

__all__ = [
    "__version__",
    "BudgetError",
    "Completion",
    "Engine",
    "EngineConfig",
    "FateEdgeError",
    "GenerateConfig",
    "GenerationError",
    "GenerationResponse",
    "ModelFormatError",
    "SamplingParams",
    "Tokenizer",
    "bundled_model_dir",
    "generate_from_model",
    "load_model",
    "stream_from_model",
]
