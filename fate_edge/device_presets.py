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

That holds where a read costs many layers of compute. It is a property of the model as much as of the device:
on the Qwen1.5-MoE-A2.7B shape (8 of 24 layers, int4 resident linears) one int4 expert read costs 0.8-3.5 MoE
layers of the same five devices' compute (``emulation.read_layers``; the inflated bundled model: 4.8-22.7), and
there the sweep's best on every device prefetches with the cross-layer gate two layers ahead over per-layer
caches. A first sweep (widths up to 2) picked LCU, two wide (simulated 62 / 81 / 110 / 13 / 257 tok/s against the
link-bound row's 57 / 73 / 100 / 12 / 240 on orin-nano / orin-nx / agx-orin / rpi5 / rtx4060; measured on the
emulated Orin Nano 66 device-equivalent tok/s against 49 and the oracle's 84). Widened to 5 and with next-use
eviction, on the store calibrated or not, the best width falls as a read gets dearer: 4 / 4 / 3 / 4 / 5 (read cost
1.15 / 1.73 / 3.47 / 1.85 / 0.79 layers; :data:`HIDING_WIDTHS`), next-use is level with LCU without calibration
counts and 3-9% ahead with them, and the simulated Orin Nano decodes 68-70 against the old row's 62-64 (oracle 85:
1.22-1.25x ahead, from 1.34x). Of what is left, perfect predictions within a token would take 77 (the oracle's
remaining edge is knowing the next token's first layer, which no causal predictor sees before the token is sampled).
Measured on the emulated devices (README, 3 interleaved rounds, device-equivalent tok/s): Orin Nano 63 against the
link-bound row's 57 and the oracle's 72; AGX Orin 110 against 111 and 167 (a read there costs 3.47 layers, near
where prefetch stops paying); RTX 4060 262 against 231 and 278.
So a caller that knows the model passes ``read_layers`` (:func:`for_device_and_store` does) and gets the prefetching
row (:data:`HIDING_PRESETS`) at or below :data:`HIDING_READ_LAYERS`; the product card's cross-layer prefetch wins
there, the link-bound row where reads are dearer.

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
_HIDES_READS: dict[str, Any] = {"allocation": "uniform", "eviction": "next-use", "predictor": "cross-layer-norm",
                                "lookahead": 2, "prefetch_gate": False, "preload": True, "keep_preloaded": False}
HIDING_PRESETS: dict[str, dict[str, Any]] = {name: _HIDES_READS for name in DEVICE_PRESETS}

# Prefetch width by what a read costs (at most that many MoE layers of compute → width): the cheaper a read, the
# more guesses fit behind compute. The sweep's best per device: rtx4060 (0.79 layers) 5, orin-nano (1.15) 4,
# orin-nx (1.73) and rpi5 (1.85) 4, agx-orin (3.47) 3; one step off costs 1-8% there.
HIDING_WIDTHS: tuple[tuple[float, int], ...] = ((1.0, 5), (2.0, 4), (HIDING_READ_LAYERS, 3))


def hiding_width(read_layers: float) -> int:
    """The prefetching row's width where one read costs ``read_layers`` MoE layers of the device's compute."""
    return next((w for most, w in HIDING_WIDTHS if read_layers <= most), HIDING_WIDTHS[-1][1])


def profile_of(device: str) -> str:
    """The profile name of a short device name (``orin-nano``, ..., emulation.DEVICES) or of a profile name."""
    from .emulation import DEVICES

    return DEVICES[device][0] if device in DEVICES else device


def for_device(policy: PolicyConfig, device: str | None, read_layers: float | None = None) -> PolicyConfig:
    """``policy`` as it runs on ``device`` (a short name or a profile name): the ``fate-edge`` preset takes that
    device's row, :data:`HIDING_PRESETS` where one expert read costs at most :data:`HIDING_READ_LAYERS` MoE layers
    of the device's compute for the model at hand (``read_layers``, from ``emulation.read_layers``), else
    :data:`DEVICE_PRESETS` (also without ``read_layers``); every other policy, and an unknown or absent device,
    is unchanged."""
    if device is None or policy.name != "fate-edge":
        return policy
    hides = read_layers is not None and read_layers <= HIDING_READ_LAYERS
    change = (HIDING_PRESETS if hides else DEVICE_PRESETS).get(profile_of(device))
    if not change:
        return policy
    if hides:
        width = hiding_width(read_layers)
        change = {**change, "prefetch_width": width, "max_prefetch_width": width}
    return policy.with_(**change)


def for_device_and_store(policy: PolicyConfig, device: str | None, store_dir, resident_bits: int | None = None
                         ) -> PolicyConfig:
    """:func:`for_device` with the read cost of ``store_dir``'s experts on ``device`` (resident linears held at
    ``resident_bits``), so the row fits the model as well as the device; without a store, :func:`for_device`."""
    if store_dir is None:
        return for_device(policy, device)
    if device is None or policy.name != "fate-edge" or profile_of(device) not in DEVICE_PRESETS:
        return policy
    from .emulation import read_layers

    return for_device(policy, device, read_layers(store_dir, device, policy.bits, resident_bits))
