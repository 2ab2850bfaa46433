"""Expert predictors: from layer i's gate input, score the experts of the next MoE layers so they can
be prefetched before they are needed. Knows nothing about caches or files.
"""

from .base import Prediction, Predictor, next_moe_layers
from .cross_layer_gate import CrossLayerGate

__all__ = ["CrossLayerGate", "Prediction", "Predictor", "next_moe_layers"]
