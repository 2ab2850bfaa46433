"""Expert predictors: from layer i's gate input, score the experts of the next MoE layers so they can
be prefetched before they are needed. Knows nothing about caches.

Every predictor answers ``predict(layer, h)``; stateful ones also learn from ``observe(layer, expert_ids)``
and forget a request on ``reset()`` (no-ops on the others).
"""

from fate_edge.predictors.activation_path import ActivationPathPredictor
from fate_edge.predictors.base import EMBEDDING, Prediction, Predictor, next_moe_layers
from fate_edge.predictors.cross_layer_gate import CrossLayerGate
from fate_edge.predictors.learned import LearnedPredictor, OnnxPredictor, train_learned
from fate_edge.predictors.oracle import CallRecorder, OraclePredictor
from fate_edge.predictors.token_popularity import TokenPopularity

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
