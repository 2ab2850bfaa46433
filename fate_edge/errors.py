"""Errors a user can act on: each names the file, tensor or key at fault and what to do about it."""


class FateEdgeError(Exception):
    """Base class for every error fate-edge raises on purpose."""


class ModelFormatError(FateEdgeError):
    """A model directory or checkpoint is missing, malformed or unsupported."""


class ModelNotFoundError(ModelFormatError):
    """A model name that is neither a path nor in a local cache."""


class UnsupportedArchitectureError(ModelFormatError):
    """config.json names a model_type this runtime does not implement."""


class MissingTensorError(ModelFormatError):
    """A tensor the architecture needs is absent from the checkpoint."""


class CorruptCheckpointError(ModelFormatError):
    """A weight file is truncated or its header is unreadable."""


class GenerationError(FateEdgeError):
    """Bad generation arguments (sampling parameters, prompt longer than the context, ...)."""


class ContextLengthError(GenerationError):
    """The prompt leaves no room in the model's context for a generated token."""

    def __init__(self, prompt_tokens: int, context: int, room: str = "the model's context", fix: str = ""):
        super().__init__(
            f"the prompt has {prompt_tokens} tokens but {room} is {context} tokens (the "
            f"prompt and at least one generated token must fit); shorten the prompt{fix}"
        )
        self.prompt_tokens = prompt_tokens
        self.context = context


class PolicyError(FateEdgeError, ValueError):
    """A policy name or setting is not one the engine implements (a ValueError too, for older callers)."""


class EngineClosedError(FateEdgeError):
    """The engine was closed; it serves no more requests."""


class StreamSupersededError(FateEdgeError):
    """An open stream was left idle and a newer request took the engine."""


class DeviceMemoryError(GenerationError):
    """The device ran out of memory in the middle of a request; the request was stopped, the engine still serves."""


class BudgetError(FateEdgeError):
    """The memory budget is too small to run the model."""


class KVRoomError(BudgetError, GenerationError):
    """One request needs more KV cache than the budget holds for all sequences: the request is too large, the
    engine is fine (a 400 to a client, not a 500)."""


class FetchError(FateEdgeError):
    """A blob could not be read."""


class CorruptBlobError(FetchError):
    """A blob's bytes do not match the checksum recorded when the store was written."""


class FetchCancelled(FetchError):
    """Waited on a request that was cancelled."""


class CalibrationError(FateEdgeError):
    """The corpus or the options cannot give a calibration (too little text, bad fractions, ...)."""


class SyntheticSpecError(ModelFormatError, ValueError):
    """A requested synthetic checkpoint cannot be built as asked (bad scale, layer count, ...)."""


class PeerUnavailableError(FateEdgeError):
    """llama-cpp-python or its sdist (for the converter) is not on this machine; the bench skips the peer."""


class ProfileError(FateEdgeError, ValueError):
    """A device profile is missing, malformed, or states a figure without a source."""


class ConvertStopped(FateEdgeError):
    """Raised inside one part of a convert (the resident weights' thread) when the other part has failed and asked
    it to stop; never reaches a user: the other part's error does."""
