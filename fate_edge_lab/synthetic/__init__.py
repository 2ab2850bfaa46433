"""Synthetic checkpoints with the published shapes of real MoE models (for benchmarks at real size)."""

from fate_edge_lab.synthetic.build import SyntheticOptions, make_synthetic_model, plan, synthetic_config
from fate_edge_lab.synthetic.layout import SyntheticSpecError, TensorSpec, tensor_specs
from fate_edge_lab.synthetic.presets import PRESETS, Preset, get_preset
from fate_edge_lab.synthetic.weights import RouterStructure, WeightInit

__all__ = [
    "PRESETS",
    "Preset",
    "RouterStructure",
    "SyntheticOptions",
    "SyntheticSpecError",
    "TensorSpec",
    "WeightInit",
    "get_preset",
    "make_synthetic_model",
    "plan",
    "synthetic_config",
    "tensor_specs",
]
