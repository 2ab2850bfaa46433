"""The presets the planner always weighs: ``--policy auto`` should give at least what the device's preset
gives. They are simulated beside the searched policies, and a searched policy replaces the best of them only when
it is predicted faster by more than the planner's own error, measured on its probe run (a policy predicted 5%
faster by a model that was 10% off on the probe is no evidence of being faster)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from fate_edge.runtime.policy import PRESETS, PolicyConfig

# The least margin a searched policy needs over the best preset, whatever the probe's error: two runs of one
# policy on a shared host differ by about this much, so a smaller predicted gain is not one.
MIN_MARGIN = 0.03


def preset_candidates(
    device: str | None = None, store_dir: str | Path | None = None, resident_bits: int | None = None
) -> list[PolicyConfig]:
    """``fate-edge`` as it runs on ``device`` (the host preset when None or unknown; device_presets.py) and
    ``fate`` as published."""
    from fate_edge.planning.device_presets import for_device_and_store

    return [for_device_and_store(PRESETS["fate-edge"], device, store_dir, resident_bits), PRESETS["fate"]]


def choose(
    searched: PolicyConfig,
    presets: Sequence[PolicyConfig],
    tokens_per_s: Callable[[PolicyConfig], float],
    margin: float,
) -> PolicyConfig:
    """The best preset by ``tokens_per_s`` (predicted), unless ``searched`` is predicted faster than it by more than
    ``margin`` (a share, at least :data:`MIN_MARGIN`)."""
    if not presets:
        return searched
    best = max(presets, key=tokens_per_s)
    if tokens_per_s(searched) > tokens_per_s(best) * (1 + max(margin, MIN_MARGIN)):
        return searched
    return best
