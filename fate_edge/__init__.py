"""fate-edge: run Mixture-of-Experts language models on devices smaller than the model."""

import os
import time

# How many spin iterations an idle OpenMP thread waits before it sleeps. With nothing else running, long enough to
# span the Python between one decode layer's kernel calls, so the second thread is still awake for the next one;
# beside other tasks, short (docs/measured-choices.md)
QUIET_SPINCOUNT = "100000"
SHORT_SPINCOUNT = "10000"


def openmp_defaults(load: float, cores: int, running_elsewhere: int | None = None) -> dict[str, str]:
    """How idle OpenMP threads should wait, chosen from the host's load when fate_edge is imported.

    Decode runs ~300 small operators a token, so waiting threads either spin (and steal the core from whoever
    they wait for when the host is busy) or sleep (and are woken for every operator): a spin while the host
    has a core per running task, passive waiting once it is oversubscribed. The measurements behind this:
    docs/performance.md, "Threads under load". ``running_elsewhere``: how many other tasks the host is running
    right now (None: unknown). Nothing else running is a quiet host whatever the 1-minute load says (that average
    still counts, for a minute, processes that have ended: a benchmark's previous run): the spin then spans a
    decode layer's Python; beside other tasks it stays short.
    """
    if running_elsewhere == 0:
        return {"GOMP_SPINCOUNT": QUIET_SPINCOUNT}
    return {"GOMP_SPINCOUNT": SHORT_SPINCOUNT} if load < cores else {"OMP_WAIT_POLICY": "PASSIVE"}


def running_elsewhere(samples: int = 5) -> int | None:
    """Tasks the host runs right now besides this one: the median of a few readings of /proc/loadavg's running
    count, a millisecond apart (one reading catches a short-lived task). None without /proc."""
    counts = []
    try:
        for i in range(samples):
            if i:
                time.sleep(0.001)
            with open("/proc/loadavg") as f:
                counts.append(int(f.read().split()[3].split("/")[0]) - 1)  # less this process's reading thread
    except (OSError, ValueError, IndexError):
        return None
    return sorted(counts)[len(counts) // 2]


# Before torch loads libgomp, which reads these once. A wait policy or spin count the user set wins (libgomp lets
# GOMP_SPINCOUNT override the policy's spin, so we never add one to a user's policy); torch imported before
# fate_edge keeps libgomp's default. FATE_EDGE_SET_OPENMP names what we set (inherited by child processes, which
# choose again), so peers with an OpenMP runtime of their own (llama.cpp links the system libgomp) start without
# it (fate_edge_lab.bench.llamacpp).
for _name in filter(None, os.environ.pop("FATE_EDGE_SET_OPENMP", "").split(",")):  # a parent's, not the user's
    os.environ.pop(_name, None)
if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ):
    _chosen = openmp_defaults(
        os.getloadavg()[0],
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
        running_elsewhere(),
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
