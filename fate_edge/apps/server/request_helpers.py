"""What every route does with a request before its own work: auth, the loaded engine, the JSON body, and
watching for the client to hang up while a job runs."""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

from starlette.requests import ClientDisconnect, Request

from fate_edge.apps.server.errors import APIError, Disconnected, invalid
from fate_edge.apps.server.protocol import parse_json_body
from fate_edge.apps.server.runner import Event, Job
from fate_edge.apps.server.state import state_of

DRAIN_LIMIT = 64 * 1024 * 1024  # an oversized body up to this size is read and dropped so the client sees the 413
BEARER = {"WWW-Authenticate": "Bearer"}  # RFC 6750: a 401 names the scheme it wants


def check_auth(request: Request) -> None:
    key = state_of(request).settings.api_key
    if not key:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if not header:
        raise APIError(
            401,
            "missing API key: send the header 'Authorization: Bearer <key>'",
            "authentication_error",
            None,
            "invalid_api_key",
            headers=BEARER,
        )
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "invalid API key", "authentication_error", None, "invalid_api_key", headers=BEARER)


def ready_engine(request: Request) -> Any:
    state = state_of(request)
    if state.closing:
        raise APIError(503, "the server is shutting down", "unavailable_error", None, "shutting_down")
    if state.engine is None:
        if state.load_error is not None:
            raise APIError(500, f"the model failed to load: {state.load_error}", "server_error")
        raise APIError(503, "Loading model", "unavailable_error", None, "model_loading", headers={"Retry-After": "1"})
    return state.engine


async def read_body(request: Request) -> bytes:
    limit = state_of(request).settings.max_body_bytes
    too_big = APIError(
        413,
        f"the request body is larger than the limit of {limit} bytes (--max-body-bytes)",
        "invalid_request_error",
        None,
        "request_too_large",
    )
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise invalid(f"bad Content-Length header {declared!r}")
        if int(declared) > DRAIN_LIMIT:
            raise too_big
    chunks: list[bytes] = []
    size = 0

    async def collect() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > DRAIN_LIMIT:
                raise too_big
            if size <= limit:
                chunks.append(chunk)

    try:
        await asyncio.wait_for(collect(), state_of(request).settings.body_timeout)
    except ClientDisconnect:  # hung up mid-upload: nobody to answer, nothing to log
        raise APIError(
            499, "the client closed the connection before sending its whole request", code="client_closed_request"
        ) from None
    except asyncio.TimeoutError:
        raise APIError(
            408,
            f"the request body did not arrive within {state_of(request).settings.body_timeout:g} s (--body-timeout)",
            code="request_timeout",
        ) from None
    if size > limit:
        raise too_big  # read to the end first, so the client is listening when the answer comes
    return b"".join(chunks)


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object. ``Content-Type: application/json`` is required: a browser page may send
    ``text/plain`` or form bodies to any address without a CORS preflight, never ``application/json``."""
    raw = await read_body(request)
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        raise APIError(
            415,
            f"send the JSON body with 'Content-Type: application/json' (got {media or 'none'!r})",
            "invalid_request_error",
            None,
            "unsupported_media_type",
        )
    return parse_json_body(raw)


class DisconnectWatch:
    """Reads the ASGI receive channel (the body already consumed) until ``http.disconnect`` arrives.

    Uvicorn reports a hang-up only to a pending ``receive()``; polling between tokens misses it when
    tokens come faster than the poll, so this task waits on it for the whole life of the job.
    """

    def __init__(self, request: Request):
        self._task = asyncio.ensure_future(self._watch(request))

    @staticmethod
    async def _watch(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def next_event(self, job: Job) -> Event:
        """The job's next event; cancels the job and raises :class:`Disconnected` if the client went away."""
        getter = asyncio.ensure_future(job.queue.get())
        try:
            done, _ = await asyncio.wait({getter, self._task}, return_when=asyncio.FIRST_COMPLETED)
            if getter in done:
                return getter.result()
            job.cancel.set()  # the worker stops before the next token (or skips the job if still queued)
            raise Disconnected()
        finally:
            if not getter.done():
                getter.cancel()

    def stop(self) -> None:
        self._task.cancel()
