"""``fate-edge`` per device: the preset re-derived on each device's emulated timeline (issue 14, item 5).

``scripts/sweep_device_presets.py`` simulated every allocation x eviction x predictor x lookahead x width x gate
on the inflated bundled model's recorded decode, on each device's timeline (this host's costs x 1/k, the device's
own link; fate_edge/emulation.py), at 20/35/50% budgets. On all five devices one expert read takes 5-8 layers of
the device's compute (Orin Nano: 0.74 ms per int4 expert over NVMe against 0.10 ms per layer), so decode is
link-bound and what matters is bytes read per token, not hiding reads behind compute. Confirmed by short
emulated runs of the engine (scripts/validate_device_presets.py, README table per device):

- one cache partition for all layers (``global``), not per-layer (uniform) nor shallow-favoring (Fate's split):
  over a 128-token decode the engine missed 309 of 2048 expert uses against uniform LCU's 365 (the simulator,
  which now starts from what the engine's prefill keeps, counts 309 and 381); the most used experts across
  layers stay, however they are spread. Over the first 32 tokens the two are level (120 against 106 misses);
- next-use eviction over it (cache/next_use.py: the expected distance to each expert's next use, from a decayed
  per-token rate seeded by calibration and the layer's inter-token transitions learned online, declining to cache
  a miss expected back later than its victim): over six prompts' 128-token decodes it misses 3539 / 848 / 163
  times at 20 / 35 / 50% where LCU (MoE-APEX, these presets' eviction before) misses 4223 / 927 / 164, and the
  simulated Orin Nano decodes 1.17x / 1.08x / 1.10x faster (scripts/analyze_misses.py); it wins on all five
  devices at every budget of the sweep's trace;
- no prefetch: in the simulator, prefetching 2 wide one layer ahead with the learned predictor wins at 20%
  (+10%) and loses 2-5% at 35/50%; every prefetch hit arrives late (a read takes 5-8 layers of compute) and wrong
  guesses add bytes to the link that is the bottleneck; even true predictions 1-3 layers ahead gain at most 6%
  over no prefetch (Orin Nano, 35%), and the engine measured 2-wide prefetch 25-30% slower (8.2 against 6.6 MB
  read per token);
- the cache filled at load with the calibration's most used experts across layers (fate_edge/preload.py
  global_choice), kept through the prompt (``keep_preloaded``: prefill reads enter only free room): a 64-token
  prompt missed 48 experts instead of 89, and the decode after it 298 instead of 309 of 2048 uses.

The host preset (``PRESETS["fate-edge"]``) stays for this host and unknown devices: there a read is cheap next
to compute and the prefetch gate decides from measured hit rates.
"""

from __future__ import annotations

from typing import Any

from .policy import PolicyConfig

# What every link-bound device changes in fate-edge (see the module docstring).
_LINK_BOUND: dict[str, Any] = {"allocation": "global", "eviction": "next-use", "predictor": None,
                               "prefetch_gate": False, "preload": True, "keep_preloaded": True}

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
