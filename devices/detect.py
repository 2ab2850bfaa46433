"""What machine are we on: RAM, cores, CUDA, and the board model of Jetsons and Raspberry Pis.

Detection only reports what the OS says; bandwidths are not measured here (that needs a timed read,
which belongs to the benchmark). ``matching_profile`` maps the host to a shipped profile when one fits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import psutil

DEVICE_TREE_MODEL = Path("/proc/device-tree/model")

# Board model substring → profile; CUDA device name substring → profile.
_BOARD_PROFILES = [
    ("Jetson AGX Orin", "jetson-agx-orin-64gb"),
    ("Jetson Orin NX", "jetson-orin-nx-16gb"),
    ("Jetson Orin Nano", "jetson-orin-nano-8gb"),
    ("Raspberry Pi 5", "raspberry-pi-5-8gb"),
]
_GPU_PROFILES = [("RTX 4090", "desktop-rtx4090"), ("RTX 4060 Laptop", "laptop-rtx4060-8gb")]
# The OS reports less than the installed memory (firmware and carve-outs take ~0.5-1 GiB on Jetsons);
# below this share of a profile's RAM it is a smaller variant (e.g. Orin Nano 4GB) that we have no profile for.
_RAM_MATCH = 0.75


@dataclass(frozen=True)
class HostInfo:
    ram_bytes: int  # total memory the OS reports
    cpu_cores: int  # physical cores when known, else logical
    cpu_threads: int  # logical CPUs
    cuda: bool  # torch.cuda.is_available(); False when torch is absent
    cuda_device: str | None  # name of CUDA device 0
    cuda_memory_bytes: int | None  # total memory of CUDA device 0
    board_model: str | None  # /proc/device-tree/model (ARM boards), None elsewhere
    profile: str | None  # closest shipped profile, None when none fits

    @property
    def is_jetson(self) -> bool:
        return is_jetson_board(self.board_model)


def is_jetson_board(board_model: str | None) -> bool:
    """A Jetson's device-tree model: its integrated GPU shares one DRAM with the CPU."""
    return board_model is not None and "Jetson" in board_model


def read_board_model(path: Path = DEVICE_TREE_MODEL) -> str | None:
    try:
        return path.read_bytes().rstrip(b"\x00\n ").decode("utf-8", errors="replace") or None
    except OSError:
        return None


def _cuda() -> tuple[bool, str | None, int | None]:
    try:
        import torch
    except ImportError:
        return False, None, None
    if not torch.cuda.is_available():
        return False, None, None
    props = torch.cuda.get_device_properties(0)
    return True, props.name, int(props.total_memory)


def matching_profile(board_model: str | None, ram_bytes: int, cuda_device: str | None = None) -> str | None:
    """Name of the shipped profile describing this host, or None."""
    from fate_edge.devices.profile import load_profile

    for key, name in _BOARD_PROFILES:
        if board_model and key in board_model:
            return name if ram_bytes >= _RAM_MATCH * load_profile(name).ram_bytes else None
    for key, name in _GPU_PROFILES:
        if cuda_device and key in cuda_device:
            return name
    return None


def detect(device_tree_model: Path = DEVICE_TREE_MODEL) -> HostInfo:
    """Describe the current host (``device_tree_model`` is a parameter so tests can fake a board)."""
    ram = int(psutil.virtual_memory().total)
    threads = os.cpu_count() or 1
    cores = psutil.cpu_count(logical=False) or threads
    cuda, device, cuda_mem = _cuda()
    board = read_board_model(device_tree_model)
    return HostInfo(ram, cores, threads, cuda, device, cuda_mem, board, matching_profile(board, ram, device))


def available_cores() -> int:
    """CPUs this process may run on (its affinity mask: a container's or taskset's limit), not the host's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def thread_split(cores: int | None = None) -> tuple[int, int]:
    """Default (torch threads, fetch workers): together no more than the ``cores`` available (one each at least).

    One thread per core, none left to spin or wait for a core: with a thread more than the cores, or other
    processes busy, OpenMP's barriers stall decode (research/bench_threads.py). Fetch workers mostly wait on
    reads, so one serves up to 4 cores and two above that; torch takes the rest."""
    cores = max(1, available_cores() if cores is None else cores)
    workers = 1 if cores <= 4 else 2
    return max(1, cores - workers), workers


def reader_contention(torch_threads: int, workers: int, cores: int | None = None) -> float:
    """Share of a reader thread's CPU time that delays compute: 1 when torch's threads already use every
    core (a 2-core host running 2 torch threads), 0 when the readers have idle cores to themselves."""
    if cores is None:
        cores = available_cores()
    return min(1.0, max(0.0, (torch_threads + workers - cores) / max(1, workers)))
