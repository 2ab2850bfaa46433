"""Errors a user can act on: each names the file, tensor or key at fault and what to do about it."""


class FateEdgeError(Exception):
    """Base class for every error fate-edge raises on purpose."""


class ModelFormatError(FateEdgeError):
    """A model directory or checkpoint is missing, malformed or unsupported."""


class UnsupportedArchitectureError(ModelFormatError):
    """config.json names a model_type this runtime does not implement."""


class MissingTensorError(ModelFormatError):
    """A tensor the architecture needs is absent from the checkpoint."""


class CorruptCheckpointError(ModelFormatError):
    """A weight file is truncated or its header is unreadable."""


class GenerationError(FateEdgeError):
    """Bad generation arguments (sampling parameters, prompt longer than the context, ...)."""


class EngineClosedError(FateEdgeError):
    """The engine was closed; it serves no more requests."""


class StreamSupersededError(FateEdgeError):
    """An open stream was left idle and a newer request took the engine."""
