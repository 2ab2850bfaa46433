"""``fate-edge`` per device: the preset re-derived on each device's emulated timeline.

Where one expert read costs many MoE layers of the device's compute, decode is link-bound: the row for the device
(:data:`DEVICE_PRESETS`) caches across layers with next-use eviction and does not prefetch. Where a read costs at
most :data:`HIDING_READ_LAYERS` layers (``read_layers``, which :func:`for_device_and_store` computes for the
model at hand), the prefetching row (:data:`HIDING_PRESETS`) reads ahead with the cross-layer gate, as wide as
:data:`HIDING_WIDTHS` gives. The host preset (``PRESETS["fate-edge"]``) stays for this host and unknown devices.
The sweep and measurements behind the rows: docs/device-presets.md.
"""

from __future__ import annotations

from typing import Any

from fate_edge.planning.device_costs import DEVICES
from fate_edge.planning.device_costs import read_layers as expert_read_layers
from fate_edge.runtime.policy import PolicyConfig

# What every link-bound device changes in fate-edge (see the module docstring).
_LINK_BOUND: dict[str, Any] = {
    "allocation": "global",
    "eviction": "next-use",
    "predictor": None,
    "prefetch_gate": False,
    "preload": True,
    "keep_preloaded": True,
}

# Profile name → the fields of fate-edge that device changes. The five are alike because each is link-bound for
# this model (the sweep's table per device: docs/emulation.md); a device where a read fits in a layer's compute would
# keep the host preset's width rule.
DEVICE_PRESETS: dict[str, dict[str, Any]] = {
    "jetson-orin-nano-8gb": _LINK_BOUND,
    "jetson-orin-nx-16gb": _LINK_BOUND,
    "jetson-agx-orin-64gb": _LINK_BOUND,
    "raspberry-pi-5-8gb": _LINK_BOUND,
    "laptop-rtx4060-8gb": _LINK_BOUND,
}


# Where a read costs at most this many MoE layers of the device's compute, reads ahead hide behind the layers they
# run beside: the prefetching row wins (0.8-3.5 on the Qwen1.5-MoE shape); the link-bound row won at 4.8-22.7.
HIDING_READ_LAYERS = 4.0

# What fate-edge changes on those devices for such a model, from the sweep on the Qwen1.5-MoE shape (the module
# docstring): per-layer caches with next-use eviction (under prefetch, 3-9% ahead of LCU on all five devices with
# calibration counts, level without), the norm-aware cross-layer gate two MoE layers ahead (within 3% of the raw one
# either way), the cache filled at load. The prompt may evict the fill: kept through the prompt (the link-bound row's
# rule), the decode after it read 28.6 MB per token against 21.1 (Orin Nano, 35%). The learned predictor is not used:
# calibrated on that model it scored better on held-out corpus text (recall@4 87% against 81%) but worse on the decode
# the engine runs (65% against 81%).
_HIDES_READS: dict[str, Any] = {
    "allocation": "uniform",
    "eviction": "next-use",
    "predictor": "cross-layer-norm",
    "lookahead": 2,
    "prefetch_gate": False,
    "preload": True,
    "keep_preloaded": False,
}
HIDING_PRESETS: dict[str, dict[str, Any]] = {name: _HIDES_READS for name in DEVICE_PRESETS}

# Prefetch width by what a read costs (at most that many MoE layers of compute → width): the cheaper a read, the
# more guesses fit behind compute. The sweep's best per device: rtx4060 (0.79 layers) 5, orin-nano (1.15) 4,
# orin-nx (1.73) and rpi5 (1.85) 4, agx-orin (3.47) 3; one step off costs 1-8% there.
HIDING_WIDTHS: tuple[tuple[float, int], ...] = ((1.0, 5), (2.0, 4), (HIDING_READ_LAYERS, 3))


def hiding_width(read_layers: float) -> int:
    """The prefetching row's width where one read costs ``read_layers`` MoE layers of the device's compute."""
    return next((w for most, w in HIDING_WIDTHS if read_layers <= most), HIDING_WIDTHS[-1][1])


def profile_of(device: str) -> str:
    """The profile name of a short device name (``orin-nano``, ..., device_costs.DEVICES) or of a profile name."""
    return DEVICES[device][0] if device in DEVICES else device


def for_device(policy: PolicyConfig, device: str | None, read_layers: float | None = None) -> PolicyConfig:
    """``policy`` as it runs on ``device`` (a short name or a profile name): the ``fate-edge`` preset takes that
    device's row, :data:`HIDING_PRESETS` where one expert read costs at most :data:`HIDING_READ_LAYERS` MoE layers
    of the device's compute for the model at hand (``read_layers``, from ``device_costs.read_layers``), else
    :data:`DEVICE_PRESETS` (also without ``read_layers``); every other policy, and an unknown or absent device,
    is unchanged."""
    if device is None or policy.name != "fate-edge":
        return policy
    hides = read_layers is not None and read_layers <= HIDING_READ_LAYERS
    change = (HIDING_PRESETS if hides else DEVICE_PRESETS).get(profile_of(device))
    if not change:
        return policy
    if hides and read_layers is not None:
        width = hiding_width(read_layers)
        change = {**change, "prefetch_width": width, "max_prefetch_width": width}
    return policy.with_(**change)


def for_device_and_store(
    policy: PolicyConfig, device: str | None, store_dir, resident_bits: int | None = None
) -> PolicyConfig:
    """:func:`for_device` with the read cost of ``store_dir``'s experts on ``device`` (resident linears held at
    ``resident_bits``), so the row fits the model as well as the device; without a store, :func:`for_device`."""
    if store_dir is None:
        return for_device(policy, device)
    if device is None or policy.name != "fate-edge" or profile_of(device) not in DEVICE_PRESETS:
        return policy
    return for_device(policy, device, expert_read_layers(store_dir, device, policy.bits, resident_bits))
