"""``fate-edge`` per device: the preset re-derived on each device's emulated timeline (issue 14, item 5).

``scripts/sweep_device_presets.py`` simulated every allocation x eviction x predictor x lookahead x width x gate
on the inflated bundled model's recorded decode, on each device's timeline (this host's costs x 1/k, the device's
own link; fate_edge/emulation.py), at 20/35/50% budgets. On all five devices one expert read takes 5-8 layers of
the device's compute (Orin Nano: 0.74 ms per int4 expert over NVMe against 0.10 ms per layer), so decode is
link-bound and what matters is bytes read per token, not hiding reads behind compute. Confirmed by short
emulated runs of the engine (scripts/validate_device_presets.py, README table per device):

- one cache partition for all layers (``global``), not per-layer (uniform) nor shallow-favoring (Fate's split):
  the simulator gives +10-25% over the host preset on every device and budget over 48 tokens (the most used
  experts across layers stay, however they are spread); the engine measured +5% at 35% on the Orin Nano;
- LCU eviction (MoE-APEX) over it: within 5% of the best eviction in every cell (LFU wins at 35% by up to 3%,
  loses at 50% by 5-8%);
- no prefetch: in the simulator, prefetching 2 wide one layer ahead with the learned predictor wins at 20%
  (+10%) and loses 2-5% at 35/50%; every prefetch hit arrives late (a read takes 5-8 layers of compute, so
  a prediction one layer ahead only starts the read earlier) and wrong guesses add bytes to the link that is
  the bottleneck; the engine measured it 25-30% slower at 35% (8.2 against 6.6 MB read per token: more
  wasted reads than the simulator charges), so no device gets it;
- the cache filled at load with the calibration's most used experts across layers (fate_edge/preload.py
  global_choice, as Fate fills its caches): a prompt reads only the rest (prefill +10-20% measured).

The host preset (``PRESETS["fate-edge"]``) stays for this host and unknown devices: there a read is cheap next
to compute and the prefetch gate decides from measured hit rates.
"""

from __future__ import annotations

from typing import Any

from .policy import PolicyConfig

# What every link-bound device changes in fate-edge (see the module docstring).
_LINK_BOUND: dict[str, Any] = {"allocation": "global", "eviction": "lcu", "predictor": None, "prefetch_gate": False,
                               "preload": True}

# Profile name → the fields of fate-edge that device changes. The five are alike because each is link-bound for
# this model (the sweep's table per device in the README); a device where a read fits in a layer's compute would
# keep the host preset's width rule.
DEVICE_PRESETS: dict[str, dict[str, Any]] = {
    "jetson-orin-nano-8gb": _LINK_BOUND,
    "jetson-orin-nx-16gb": _LINK_BOUND,
    "jetson-agx-orin-64gb": _LINK_BOUND,
    "raspberry-pi-5-8gb": _LINK_BOUND,
    "laptop-rtx4060-8gb": _LINK_BOUND,
}


def profile_of(device: str) -> str:
    """The profile name of a short device name (``orin-nano``, ..., emulation.DEVICES) or of a profile name."""
    from .emulation import DEVICES

    return DEVICES[device][0] if device in DEVICES else device


def for_device(policy: PolicyConfig, device: str | None) -> PolicyConfig:
    """``policy`` as it runs on ``device`` (a short name or a profile name): the ``fate-edge`` preset takes that
    device's row of :data:`DEVICE_PRESETS`; every other policy, and an unknown or absent device, is unchanged."""
    if device is None or policy.name != "fate-edge":
        return policy
    change = DEVICE_PRESETS.get(profile_of(device))
    return policy.with_(**change) if change else policy
