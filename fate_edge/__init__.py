"""fate-edge: run Mixture-of-Experts language models on devices smaller than the model."""

from .bundled import bundled_model_dir
from .engine import BudgetError, Completion, Engine
from .errors import FateEdgeError, GenerationError, ModelFormatError
from .generate import GenerateConfig, GenerationResponse, generate, stream_generate
from .loader import load_model
from .sampling import SamplingParams
from .tokenizer import Tokenizer

__version__ = "0.1.0"

__all__ = [
    "BudgetError",
    "Completion",
    "Engine",
    "FateEdgeError",
    "GenerateConfig",
    "GenerationError",
    "GenerationResponse",
    "ModelFormatError",
    "SamplingParams",
    "Tokenizer",
    "bundled_model_dir",
    "generate",
    "load_model",
    "stream_generate",
]
