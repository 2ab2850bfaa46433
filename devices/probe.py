"""Measure this machine and write its ``host`` profile (``fate-edge probe``).

Every figure is measured here, and its source says how: memory bandwidth from a large array copy,
fp32 compute from a matmul, storage bandwidth from O_DIRECT (else buffered) sequential reads of a
temporary file in the directory experts would be read from, latency from 4 KiB random reads at queue
depth 1. The profile is cached (default ``~/.cache/fate-edge/host.toml``) so later runs reuse it.
"""

from __future__ import annotations

import datetime as _dt
import mmap
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import psutil
import torch
from fate_edge.devices.profile import DeviceProfile

from fate_edge.app_dirs import cache_home


def default_path() -> Path:
    return cache_home() / "host.toml"


def memory_bandwidth_gbps(mb: int = 256, repeats: int = 5) -> float:
    src = torch.empty(mb * 2**20 // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * 4 / statistics.median(times) / 1e9  # read + write


def matmul_gflops(n: int = 1024, repeats: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times) / 1e9


def storage(directory: Path, mb: int = 128, chunk: int = 1 << 20) -> tuple[float, float, str]:
    """(sequential GB/s, 4 KiB random-read latency in µs, how it was read)."""
    fd_tmp, name = tempfile.mkstemp(dir=directory, prefix=".fate-probe-")
    try:
        with os.fdopen(fd_tmp, "wb") as f:
            block = os.urandom(chunk)
            for _ in range(mb * (1 << 20) // chunk):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        how = "O_DIRECT"
        try:
            fd = os.open(name, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            buf = mmap.mmap(-1, chunk)
            os.preadv(fd, [memoryview(buf)], 0)
        except OSError:
            fd = os.open(name, os.O_RDONLY)
            buf = mmap.mmap(-1, chunk)
            how = "buffered (O_DIRECT unavailable; the page cache may flatter this)"
        try:
            view = memoryview(buf)
            t0 = time.perf_counter()
            for off in range(0, mb * (1 << 20), chunk):
                os.preadv(fd, [view], off)
            seq = mb * (1 << 20) / (time.perf_counter() - t0) / 1e9
            small = memoryview(buf)[:4096]
            lat = []
            for _ in range(200):
                off = random.randrange(0, mb * (1 << 20) // 4096) * 4096
                t0 = time.perf_counter()
                os.preadv(fd, [small], off)
                lat.append(time.perf_counter() - t0)
        finally:
            os.close(fd)
        return seq, statistics.median(lat) * 1e6, how
    finally:
        os.unlink(name)


def probe(directory: Path | None = None, storage_mb: int = 128, memory_mb: int = 256) -> DeviceProfile:
    directory = directory or default_path().parent
    directory.mkdir(parents=True, exist_ok=True)
    when = _dt.date.today().isoformat()
    mem_bw = memory_bandwidth_gbps(memory_mb)
    gflops = matmul_gflops()
    seq, lat, how = storage(directory, storage_mb)
    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    src = f"measured by fate-edge probe on {when}"
    return DeviceProfile(
        name="host",
        description=f"this machine ({os.cpu_count()} threads), measured",
        ram_bytes=int(psutil.virtual_memory().total),
        memory_bandwidth_gbps=round(mem_bw, 2),
        storage_read_gbps=round(seq, 3),
        storage_latency_us=round(lat, 1),
        cpu_cores=cores,
        cpu_gflops_fp32=round(gflops, 1),
        unified_memory=True,
        sources={
            "ram_bytes": f"psutil.virtual_memory().total, {src}",
            "memory_bandwidth_gbps": f"{memory_mb} MB tensor copy (read + write), median of 5, {src}",
            "storage_read_gbps": f"{storage_mb} MB sequential 1 MiB reads, {how}, in {directory}, {src}",
            "storage_latency_us": f"4 KiB random reads at queue depth 1, median of 200, {how}, {src}",
            "cpu_cores": f"psutil physical cores, {src}",
            "cpu_gflops_fp32": f"1024x1024 fp32 matmul with {torch.get_num_threads()} threads, median of 5, {src}",
        },
    )


def to_toml(p: DeviceProfile) -> str:
    lines = [f'name = "{p.name}"', f'description = "{p.description}"']
    for key, value in p.figures.items():
        lines.append(f"{key} = {value}")
    lines.append(f"unified_memory = {'true' if p.unified_memory else 'false'}")
    lines.append("")
    lines.append("[sources]")
    for key, value in p.sources.items():
        lines.append(f'{key} = "{value}"')
    return "\n".join(lines) + "\n"


def host_profile(refresh: bool = False) -> DeviceProfile:
    """The cached host profile, probing (about ten seconds) the first time or when ``refresh``."""
    from fate_edge.devices.profile import load_profile

    path = default_path()
    if refresh or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(to_toml(probe(path.parent)))
    return load_profile(path)
