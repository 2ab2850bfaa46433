"""The assistant daemon: an OpenAI-compatible HTTP API over one shared :class:`~fate_edge.runtime.engine.Engine`.

Routes: ``POST /v1/chat/completions`` (routes_chat), ``POST /v1/completions`` (routes_completions), ``GET
/v1/models[/{id}]`` (routes_models), ``GET /health``, ``GET /metrics`` and the opt-in fault injection
(routes_admin). They share one :class:`~fate_edge.apps.server.state.ServerState`, stored as ``app.state.fate_edge``.

The model loads once, in a background thread, and is shared by every request. Requests run one at a
time on a worker thread (the engine's KV and expert caches are shared state); up to ``max_queue`` wait
behind the running one and the next gets a 429. A request whose client disconnects is stopped before
its next token, or dropped from the queue if it had not started.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from fate_edge.apps.server import routes_admin, routes_chat, routes_completions, routes_models
from fate_edge.apps.server.errors import APIError
from fate_edge.apps.server.middleware import BrowserGuard, Observe
from fate_edge.apps.server.state import ServerSettings, ServerState
from fate_edge.version import __version__

__all__ = ["ServerSettings", "ServerState", "create_app"]

log = logging.getLogger("fate_edge.apps.server")


def _load(state: ServerState, on_load_error) -> None:
    from fate_edge.apps.engine_args import open_engine

    t0 = time.perf_counter()
    try:
        # Concurrent requests are batched unless --max-batch says otherwise (0: the machine's default size).
        # progress=False: a conversion on first use goes to the log (fate_edge.convert) and to /health (status)
        eng = open_engine(state.settings.engine, progress=False, account=sys.stderr, max_batch=0, status=state.status)
        state.ready(eng)
        log.info(
            "model %s ready in %.1f s (policy %s, expert budget %.1f MB)",
            state.model_id,
            time.perf_counter() - t0,
            eng.policy.name,
            eng.budget / 1e6,
        )
    except BaseException as exc:  # noqa: BLE001 - reported through /health and on_load_error
        state.load_error = exc
        log.error("cannot load the model: %s", exc)
        if on_load_error is not None:
            on_load_error(exc)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return APIError(404, f"no route {request.method} {request.url.path}", "not_found_error").response()
        if exc.status_code == 405:
            return APIError(
                405, f"method {request.method} is not allowed on {request.url.path}", "invalid_request_error"
            ).response()
        return APIError(exc.status_code, str(exc.detail), "invalid_request_error").response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").response()


def create_app(settings: ServerSettings | None = None, engine: Any = None, on_load_error=None) -> FastAPI:
    """The daemon's ASGI app. Pass ``engine`` to serve an engine you built; otherwise it loads in the background.

    ``on_load_error(exc)`` is called (from the loading thread) if the model cannot be loaded; the CLI
    uses it to stop the server and exit with the error.
    """
    state = ServerState.create(settings or ServerSettings())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if engine is not None:
            state.ready(engine)
        else:
            threading.Thread(target=_load, args=(state, on_load_error), name="fate-edge-load", daemon=True).start()
        yield
        state.closing = True
        if state.runner is not None:
            await run_in_threadpool(state.runner.shutdown)
        if state.engine is not None and engine is None:
            state.engine.close()

    app = FastAPI(
        title="fate-edge", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.fate_edge = state
    if state.settings.cors_origins:  # answers preflights and adds the CORS headers for the allowed origins
        app.add_middleware(
            CORSMiddleware,
            allow_origins=state.settings.cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["*"],
        )
    app.add_middleware(BrowserGuard, settings=state.settings)
    app.add_middleware(Observe, metrics=state.metrics)  # added last: outermost, so it counts rejections too
    _add_error_handlers(app)
    for module in (routes_completions, routes_chat, routes_models, routes_admin):
        app.include_router(module.router)
    if state.settings.enable_fault_injection:
        app.include_router(routes_admin.fault_router)
    return app
