"""Errors in the OpenAI shape, with llama-server's error types.

Every error the daemon returns is ``{"error": {"message", "type", "param", "code"}}``:

=============================  ======  ==================================================================
type                           status  when
=============================  ======  ==================================================================
``invalid_request_error``      400     malformed JSON or UTF-8, a wrong type or range, an unsupported option
``exceed_context_size_error``  400     the prompt does not fit in the model's context
``invalid_request_error``      400     prompt + max_tokens need more KV cache than the memory budget holds
``authentication_error``       401     ``--api-key`` set and the bearer token is missing or wrong
``permission_error``           403     a ``Host`` not in ``--allowed-hosts`` or an ``Origin`` not in ``--cors-origins``
``not_found_error``            404     unknown model or route
``invalid_request_error``      405     wrong HTTP method
``invalid_request_error``      408     the body did not arrive within ``--body-timeout``
``invalid_request_error``      413     request body over ``--max-body-bytes``
``invalid_request_error``      415     a JSON body sent without ``Content-Type: application/json``
``unavailable_error``          429     the request queue is full (``--max-queue``); retry later
``server_error``               500     generation failed (a read error in the expert store, say)
``unavailable_error``          503     the model is still loading, or the GPU ran out of memory mid-request
=============================  ======  ==================================================================
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi.responses import JSONResponse

from fate_edge.errors import ContextLengthError, DeviceMemoryError, FateEdgeError, GenerationError, KVRoomError

log = logging.getLogger("fate_edge.apps.server")


class QueueFull(Exception):
    """``--max-queue`` requests already wait behind the running one (answered as a 429)."""


class Disconnected(Exception):
    """The client hung up before the job's answer was complete."""


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers
        self.extra = extra

    def body(self) -> dict[str, Any]:
        return {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code, **self.extra}
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unsupported(param: str, what: str) -> APIError:
    return APIError(
        400,
        f"'{param}': {what} is not supported by this server",
        "invalid_request_error",
        param,
        "unsupported_parameter",
    )


def error_from_exception(exc: BaseException, param: str | None = None) -> APIError:
    """The API error for an exception raised while preparing or running a generation (by type, never by text)."""
    if isinstance(exc, ContextLengthError):
        return APIError(
            400,
            str(exc),
            "exceed_context_size_error",
            param,
            "context_length_exceeded",
            n_prompt_tokens=exc.prompt_tokens,
            n_ctx=exc.context,
        )
    if isinstance(exc, KVRoomError):  # this request is too large for the memory budget; a retry fails the same way
        return APIError(400, str(exc), "invalid_request_error", param, "kv_room_exceeded")
    if isinstance(exc, DeviceMemoryError):  # transient: the engine still serves; retry later or ask for less
        return APIError(503, str(exc), "unavailable_error", None, "device_out_of_memory")
    if isinstance(exc, GenerationError):
        return invalid(str(exc))
    # the server's own trouble: its log has the whole message; the client's names no path on this machine
    log.warning("generation failed: %s: %s", type(exc).__name__, exc)
    if isinstance(exc, FateEdgeError):
        return APIError(500, f"generation failed: {redact_paths(str(exc))}", "server_error", None, "generation_failed")
    return APIError(
        500,
        f"generation failed: {type(exc).__name__}: {redact_paths(str(exc))}",
        "server_error",
        None,
        "internal_error",
    )


_ABSOLUTE_PATH = re.compile(r"(?<![\w.])/(?:[^\s:'\"/]+/)*([^\s:'\"/]+)")


def redact_paths(text: str) -> str:
    """``text`` with each absolute path cut to its last part (``/home/u/.cache/s/experts-4.bin``: ``experts-4.bin``)."""
    return _ABSOLUTE_PATH.sub(lambda m: m.group(1), text)
