"""Device-faithful emulation: a device's compute time from its roofline, and the link dilated to match this host.

This host computes a decode token far slower than, say, a Jetson's GPU. Throttling reads to the device's link
alone would give the host's compute the device's link: loads would look cheap next to compute. Emulation
instead runs the whole device timeline ``k`` times slower, where ``k`` = host time / device time for the same
compute: the link's bandwidth is divided by ``k`` and its latency multiplied by ``k``, so the ratio of compute
to loading is the device's, and a tokens/s measured here times ``k`` is the device-equivalent figure.

The device time comes from a roofline (MoE-Lightning's view of batch-1 decode): max(bytes read / memory
bandwidth, FLOPs / peak), each peak times an efficiency a real decode achieves. This module knows devices, not
models: the caller passes a token's (or a layer's) bytes and FLOPs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fate_edge.devices.link import LinkSpec
from fate_edge.devices.profile import DeviceProfile

# Share of the roofline peaks a batch-1 decode achieves, for a profile that states no roofline_efficiency
# (a probed host profile, a user's TOML). Source: AWQ (Lin et al., MLSys 2024, arXiv 2306.00978), TinyChat
# decoding Llama-2-7B W4A16 on a Jetson AGX Orin 64GB reads its weights at about 0.71 of the memory's peak (the
# derivation: docs/measured-choices.md).
DEFAULT_EFFICIENCY = 0.7
DEFAULT_EFFICIENCY_SOURCE = (
    "fate_edge.devices.emulate.DEFAULT_EFFICIENCY: AWQ/TinyChat Llama-2-7B W4A16 39.1 tok/s "
    "on a Jetson AGX Orin 64GB = ~145 GB/s of 204.8 (arXiv 2306.00978)"
)


@dataclass(frozen=True)
class Roofline:
    """The peaks a device's decode runs against, and the share of them it achieves."""

    device: str
    bandwidth_bytes_per_s: float  # memory the compute reads weights from (unified DRAM, or GPU memory)
    flops_per_s: float  # peak of the unit that computes (dense fp16 tensor cores, CUDA cores, or the CPU)
    efficiency: float
    compute_unit: str  # which peak: says what the figure assumes
    efficiency_source: str

    def time_s(self, nbytes: float, flops: float) -> float:
        """Seconds the device takes to compute what reads ``nbytes`` of weights and does ``flops``."""
        return max(
            nbytes / (self.bandwidth_bytes_per_s * self.efficiency), flops / (self.flops_per_s * self.efficiency)
        )


def device_roofline(profile: DeviceProfile) -> Roofline:
    """The roofline of ``profile``'s compute: the GPU where it has one (dense fp16 tensor cores when the profile
    states them, else CUDA-core fp32), else the CPU; weights in GPU memory on a discrete GPU, else in DRAM."""
    if profile.gpu_tflops_fp16_tensor:
        flops, unit = profile.gpu_tflops_fp16_tensor * 1e12, "GPU dense fp16 tensor cores"
    elif profile.gpu_tflops_fp32:
        flops, unit = profile.gpu_tflops_fp32 * 1e12, "GPU CUDA-core fp32"
    else:
        flops, unit = profile.cpu_gflops_fp32 * 1e9, "CPU fp32"
    bandwidth = (
        profile.accelerator_bandwidth_gbps if profile.accelerator_bandwidth_gbps else profile.memory_bandwidth_gbps
    )
    if profile.roofline_efficiency is not None:
        eff, src = profile.roofline_efficiency, profile.sources.get("roofline_efficiency", "the profile")
    else:
        eff, src = DEFAULT_EFFICIENCY, DEFAULT_EFFICIENCY_SOURCE
    return Roofline(profile.name, bandwidth * 1e9, flops, eff, unit, src)


def dilation(host_s: float, device_s: float) -> float:
    """k = host time / device time for the same compute: how many times slower this host runs the device's
    timeline (below 1 when the host is the faster one)."""
    if host_s <= 0 or device_s <= 0:
        raise ValueError(f"dilation needs positive times, got host {host_s} s and device {device_s} s")
    return host_s / device_s


def dilated_link(spec: LinkSpec, k: float) -> LinkSpec:
    """``spec`` on the host's timeline: bandwidth / k, latency x k (a transfer takes k times as long)."""
    if k <= 0:
        raise ValueError(f"dilation must be > 0, got {k}")
    return dataclasses.replace(
        spec,
        name=f"{spec.name}, dilated x{k:.3g}",
        bandwidth_bytes_per_s=spec.bandwidth_bytes_per_s / k,
        latency_s=spec.latency_s * k,
    )


def reads_direct(link: LinkSpec, nbytes: int, disk_read_s: float | None) -> bool:
    """Read with O_DIRECT (as a DMA: no page-cache copy on this host's CPU) when this disk reads ``nbytes`` direct
    in less time than ``link`` moves them, so the link still sets the speed; else buffered from a warm page cache.
    ``disk_read_s``: one direct read of ``nbytes`` measured here (None: O_DIRECT unavailable)."""
    return disk_read_s is not None and disk_read_s < link.transfer_time(nbytes)
