"""What an :class:`~fate_edge.runtime.engine.Engine` is built from: one dataclass, every field a default, and where
``policy="auto"`` goes (the planner, a layer above the runtime, registers itself: :func:`set_planner`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from fate_edge import defaults
from fate_edge.devices.link import ThrottledLink
from fate_edge.errors import FateEdgeError
from fate_edge.runtime.policy import PolicyConfig


@dataclass
class Trace:
    """A recorded run's expert accesses: (layer, experts in the order the engine uses them) per MoE call."""

    calls: list[tuple[int, list[int]]] = field(default_factory=list)

    def accesses(self) -> list[tuple[int, int]]:
        return [(layer, e) for layer, ids in self.calls for e in ids]


@dataclass
class EngineConfig:
    """An engine: which store, under which budget, with which policy, on which device."""

    store_dir: str | Path  # an expert store (fate-edge convert); Engine.load converts a model directory into one
    memory_budget: int | str = defaults.MEMORY_BUDGET  # bytes for everything expert-sized, e.g. "4GB"
    policy: str | PolicyConfig = defaults.POLICY  # a preset name, a PolicyConfig, or "auto" (the planner picks)
    dtype: str | torch.dtype = defaults.DTYPE  # the compute dtype
    link: ThrottledLink | None = None  # an emulated link the expert reads go through
    trace: Trace | None = None  # a recorded run of the same request (the oracle replays it)
    workers: int = defaults.FETCH_WORKERS  # fetch threads
    device: str = "cpu"  # cpu, cuda, cuda:N or auto
    max_inflight_prefetches: int = 8
    direct_io: bool = True  # O_DIRECT expert reads where the file system takes them
    verify: str = defaults.VERIFY  # CRC32 of each blob: "once" (its first read) or "always"
    resident_bits: int | None = None  # 8 or 4: attention, dense MLPs, shared experts and lm_head quantized
    context_tokens: int = defaults.CONTEXT_TOKENS  # prompt + answer the memory account reserves room for
    embedding_bits: int | None = None  # 8 or 4: the embedding table held quantized (fate_edge.model.embedding)
    max_batch: int = 1  # >1: concurrent streams run as one batch (runtime.batch); 0: the machine's default
    plan_sample: str | list[int] | None = None  # with policy "auto": a prompt like the ones to serve (docs/planner.md)
    # finished requests' KV kept for later prompts (runtime.prompt_cache), a part of the memory account: "auto" (one
    # context_tokens of KV), a size such as "256MB", or 0 (off)
    prompt_cache: int | str = "auto"
    # Host memory for experts between the store and a discrete GPU's cache (runtime.host_tier): "auto" (every expert
    # where half the free host memory holds them), a size such as "8GB", or 0 (none). None on one memory (CPU, Jetson)
    host_memory: int | str = "auto"


class PolicyChoice(Protocol):
    """What the planner answers for policy "auto": the policy, with its prediction (planning.planner.Plan)."""

    @property
    def policy(self) -> PolicyConfig: ...


_planner: list[Callable[[EngineConfig], PolicyChoice]] = []  # at most one: set_planner's


def set_planner(plan: Callable[[EngineConfig], PolicyChoice]) -> None:
    """Where ``policy="auto"`` goes. The planner probes engines, so it sits a layer above the runtime; the package
    (``fate_edge/__init__.py``) hands it down here once, at import."""
    _planner[:] = [plan]


def plan_policy(config: EngineConfig) -> PolicyChoice:
    """The planner's choice for ``config`` (policy "auto")."""
    if not _planner:
        raise FateEdgeError("policy 'auto' needs the planner: import fate_edge (it registers fate_edge.planning.auto)")
    return _planner[0](config)


def resolve_device(device: str) -> str:
    """ "auto" → cuda when torch sees a GPU, else cpu; "cuda" without a GPU is a clear error."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise FateEdgeError(
            "device 'cuda' requested but torch sees no CUDA GPU (is this the CPU build of torch, "
            "or is the driver missing?); use --device cpu or auto"
        )
    if device != "cpu" and not device.startswith("cuda"):
        raise FateEdgeError(f"unknown device '{device}'; use auto, cpu or cuda")
    return device
