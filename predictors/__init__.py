"""Expert predictors: from layer i's gate input, score the experts of the next MoE layers so they can
be prefetched before they are needed. Knows nothing about caches.

Every predictor answers ``predict(layer, h)``; stateful ones also learn from ``observe(layer, expert_ids)``
and forget a request on ``reset()`` (no-ops on the others).
"""

from .activation_path import ActivationPathPredictor
from .base import EMBEDDING, Prediction, Predictor, next_moe_layers
from .cross_layer_gate import CrossLayerGate
from .learned import LearnedPredictor, OnnxPredictor, train_learned
from .oracle import CallRecorder, OraclePredictor
from .token_popularity import TokenPopularity

__all__ = [
    "EMBEDDING",
    "ActivationPathPredictor",
    "CallRecorder",
    "CrossLayerGate",
    "LearnedPredictor",
    "OnnxPredictor",
    "OraclePredictor",
    "Prediction",
    "Predictor",
    "TokenPopularity",
    "next_moe_layers",
    "train_learned",
]
