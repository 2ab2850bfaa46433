"""The assistant daemon: an OpenAI-compatible HTTP API over one shared :class:`~fate_edge.engine.Engine`.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON or SSE streaming), ``GET /v1/models``,
``GET /v1/models/{id}``, ``GET /health`` (503 while the model loads, like llama-server), ``GET /metrics``
(Prometheus text). With ``enable_fault_injection`` only: ``POST /debug/fault-injection`` (see below).

The model loads once, in a background thread, and is shared by every request. Requests run one at a
time on a worker thread (the engine's KV and expert caches are shared state); up to ``max_queue`` wait
behind the running one and the next gets a 429. A request whose client disconnects is stopped before
its next token, or dropped from the queue if it had not started.

Fault injection (testing only; the route does not exist unless the server was started with
``--enable-fault-injection``): ``POST /debug/fault-injection {"reads": 1}`` makes the next ``reads``
demand reads of expert bytes (reads a running request waits for) fail with an I/O error, so the request
that needs them fails with a 500 ``server_error`` and the next one is served normally.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import logging
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import FateEdgeError, GenerationError
from .errors import APIError, invalid
from .metrics import Metrics
from .protocol import parse_json_body, parse_request
from .runner import Event, Job, QueueFull, Runner

log = logging.getLogger("fate_edge.server")

ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/debug/fault-injection"}
DRAIN_LIMIT = 64 * 1024 * 1024  # an oversized body up to this size is read and dropped so the client sees the 413


@dataclass
class ServerSettings:
    model: str | None = None  # model directory or expert store; None: the bundled model
    memory_budget: int | str = "256MB"
    policy: str = "fate-edge"
    device: str = "auto"
    dtype: str = "float32"
    api_key: str | None = None
    max_queue: int = 16
    max_body_bytes: int = 1_000_000
    default_max_tokens: int = 256
    model_alias: str | None = None
    enable_fault_injection: bool = False


class _State:
    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.engine: Any = None
        self.runner: Runner | None = None
        self.load_error: BaseException | None = None
        self.metrics = Metrics()
        self.started = int(time.time())
        self.fail_reads = 0
        self.fault_lock = threading.Lock()
        from ..bundled import bundled_model_dir

        self.model_id = settings.model_alias or Path(settings.model or bundled_model_dir()).resolve().name

    def ready(self, engine: Any) -> None:
        if self.settings.enable_fault_injection:
            engine.fetch.fault_injector = self._inject
        self.runner = Runner(engine, self.settings.max_queue, on_finish=self.metrics.job_finished)
        self.engine = engine  # set last: /health turns 200 only when everything is in place

    def _inject(self, ref: Any) -> None:
        from ..fetch import Priority

        with self.fault_lock:
            if self.fail_reads <= 0:
                return
            req = self.engine.fetch._pending.get(ref.key)
            if req is None or req.priority != Priority.DEMAND:
                return  # only reads a request waits for: a failed prefetch could be dropped unseen
            self.fail_reads -= 1
        raise OSError(errno.EIO, "injected read error (fault injection)")


def _error_from_exception(exc: BaseException) -> APIError:
    if isinstance(exc, GenerationError):
        if "context" in str(exc):
            return APIError(400, str(exc), "exceed_context_size_error", "messages", "context_length_exceeded")
        return invalid(str(exc))
    if isinstance(exc, FateEdgeError):
        return APIError(500, f"generation failed: {exc}", "server_error", None, "generation_failed")
    return APIError(500, f"generation failed: {type(exc).__name__}: {exc}", "server_error", None, "internal_error")


class _Observe:
    """ASGI middleware: request counts by endpoint and status, and latency (to the last byte sent)."""

    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = 500

        async def send_wrap(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrap)
        finally:
            path = scope.get("path", "")
            endpoint = path if path in ENDPOINTS else ("/v1/models" if path.startswith("/v1/models/") else "other")
            self.metrics.request(endpoint, status, time.perf_counter() - start)


class _Disconnected(Exception):
    pass


def create_app(settings: ServerSettings | None = None, engine: Any = None, on_load_error=None) -> FastAPI:
    """The daemon's ASGI app. Pass ``engine`` to serve an engine you built; otherwise it loads in the background.

    ``on_load_error(exc)`` is called (from the loading thread) if the model cannot be loaded; the CLI
    uses it to stop the server and exit with the error.
    """
    settings = settings or ServerSettings()
    state = _State(settings)

    def load() -> None:
        from ..engine import Engine

        t0 = time.perf_counter()
        try:
            eng = Engine.load(settings.model, settings.memory_budget, settings.policy, device=settings.device,
                              dtype=settings.dtype)
            state.ready(eng)
            log.info("model %s ready in %.1f s (policy %s, expert budget %.1f MB)", state.model_id,
                     time.perf_counter() - t0, eng.policy.name, eng.budget / 1e6)
        except BaseException as exc:  # noqa: BLE001 - reported through /health and on_load_error
            state.load_error = exc
            log.error("cannot load the model: %s", exc)
            if on_load_error is not None:
                on_load_error(exc)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if engine is not None:
            state.ready(engine)
        else:
            threading.Thread(target=load, name="fate-edge-load", daemon=True).start()
        yield
        if state.runner is not None:
            await run_in_threadpool(state.runner.shutdown)
        if state.engine is not None and engine is None:
            state.engine.close()

    app = FastAPI(title="fate-edge", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.fate_edge = state
    app.add_middleware(_Observe, metrics=state.metrics)

    # ------------------------------------------------------------------ errors
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return APIError(404, f"no route {request.method} {request.url.path}", "not_found_error").response()
        if exc.status_code == 405:
            return APIError(405, f"method {request.method} is not allowed on {request.url.path}",
                            "invalid_request_error").response()
        return APIError(exc.status_code, str(exc.detail), "invalid_request_error").response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").response()

    # ----------------------------------------------------------------- helpers
    def check_auth(request: Request) -> None:
        if not settings.api_key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if not header:
            raise APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                           "authentication_error", None, "invalid_api_key")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), settings.api_key.encode()):
            raise APIError(401, "invalid API key", "authentication_error", None, "invalid_api_key")

    def ready_engine() -> Any:
        if state.engine is None:
            if state.load_error is not None:
                raise APIError(500, f"the model failed to load: {state.load_error}", "server_error")
            raise APIError(503, "Loading model", "unavailable_error", None, "model_loading",
                           headers={"Retry-After": "1"})
        return state.engine

    async def read_body(request: Request) -> bytes:
        limit = settings.max_body_bytes
        too_big = APIError(413, f"the request body is larger than the limit of {limit} bytes (--max-body-bytes)",
                           "invalid_request_error", None, "request_too_large")
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                raise invalid(f"bad Content-Length header {declared!r}")
            if int(declared) > DRAIN_LIMIT:
                raise too_big
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > DRAIN_LIMIT:
                raise too_big
            if size <= limit:
                chunks.append(chunk)
        if size > limit:
            raise too_big  # read to the end first, so the client is listening when the answer comes
        return b"".join(chunks)

    async def next_event(job: Job, request: Request) -> Event:
        """The job's next event; cancels the job and raises _Disconnected if the client goes away meanwhile."""
        getter = asyncio.ensure_future(job.queue.get())
        try:
            while True:
                done, _ = await asyncio.wait({getter}, timeout=0.25)
                if done:
                    return getter.result()
                if await request.is_disconnected():
                    job.cancel.set()
                    raise _Disconnected()
        finally:
            if not getter.done():
                getter.cancel()

    # ------------------------------------------------------------------ routes
    @app.get("/health")
    async def health():
        if state.engine is not None:
            return {"status": "ok"}
        if state.load_error is not None:
            return JSONResponse({"status": "error", **APIError(500, f"the model failed to load: {state.load_error}",
                                                               "server_error").body()}, status_code=500)
        return JSONResponse({"status": "loading", **APIError(503, "Loading model", "unavailable_error").body()},
                            status_code=503, headers={"Retry-After": "1"})

    @app.get("/metrics")
    async def metrics(request: Request):
        check_auth(request)
        text = state.metrics.render(state.engine, state.runner, state.engine is not None, state.model_id,
                                    str(settings.policy))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict[str, Any]:
        card: dict[str, Any] = {"id": state.model_id, "object": "model", "created": state.started,
                                "owned_by": "fate-edge"}
        eng = state.engine
        if eng is not None:
            card["meta"] = {"context_length": eng.model.config.max_position_embeddings,
                            "policy": eng.policy.name, "memory_budget_bytes": eng.budget, "device": eng.device}
        return card

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        check_auth(request)
        if model_id != state.model_id:
            raise APIError(404, f"model '{model_id}' not found; this server serves '{state.model_id}'",
                           "not_found_error", "model", "model_not_found")
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "completion")

    if settings.enable_fault_injection:
        @app.post("/debug/fault-injection")
        async def fault_injection(request: Request):
            check_auth(request)
            ready_engine()
            body = parse_json_body(await read_body(request))
            reads = body.get("reads", 1)
            if isinstance(reads, bool) or not isinstance(reads, int) or not 0 <= reads <= 1000:
                raise invalid("'reads' must be an integer in [0, 1000]", "reads")
            with state.fault_lock:
                state.fail_reads = reads
            log.warning("fault injection armed: the next %d demand read(s) will fail", reads)
            return {"armed_reads": reads}

    # -------------------------------------------------------------- generation
    async def generate(request: Request, kind: str):
        t0 = time.perf_counter()
        check_auth(request)
        eng = ready_engine()
        body = parse_json_body(await read_body(request))
        model_name = body.get("model")
        if isinstance(model_name, str) and model_name != state.model_id:
            raise APIError(404, f"model '{model_name}' not found; this server serves '{state.model_id}'",
                           "not_found_error", "model", "model_not_found")
        context = eng.model.config.max_position_embeddings

        def prepare():
            parsed = parse_request(kind, body, context, eng.tokenizer.vocab_size, settings.default_max_tokens,
                                   eng.tokenizer.apply_chat_template)
            ids = eng.tokenizer.encode(parsed.prompt) if isinstance(parsed.prompt, str) else parsed.prompt
            return parsed, ids

        parsed, ids = await run_in_threadpool(prepare)
        if not ids:
            raise invalid("the prompt encodes to no tokens; send some text", "prompt" if kind != "chat" else "messages")
        if len(ids) >= context:
            raise APIError(400, f"the request has {len(ids)} prompt tokens but the model's context is {context} "
                                "tokens (the prompt and at least one generated token must fit); shorten it",
                           "exceed_context_size_error", "messages" if kind == "chat" else "prompt",
                           "context_length_exceeded", n_prompt_tokens=len(ids), n_ctx=context)
        job = Job(ids, parsed.config, asyncio.get_running_loop())
        try:
            state.runner.submit(job)
        except QueueFull as exc:
            raise APIError(429, f"the server is busy: {exc}; retry later", "unavailable_error", None,
                           "queue_full", headers={"Retry-After": "1"}) from None
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        endpoint = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        try:
            first = await next_event(job, request)
        except _Disconnected:
            return Response(status_code=499)
        except BaseException:
            job.cancel.set()
            raise
        if first.kind == "error":
            raise _error_from_exception(first.error)
        state.metrics.first_token(endpoint, time.perf_counter() - t0)
        if parsed.stream:
            return StreamingResponse(stream(job, first, parsed, rid, created), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        parts, last, ev = [], None, first
        try:
            while ev.kind == "token":
                parts.append(ev.step.text)
                last = ev.step
                ev = await next_event(job, request)
        except _Disconnected:
            return Response(status_code=499)
        finally:
            job.cancel.set()  # no-op once finished; stops the worker if this handler is cancelled
        if ev.kind == "error":
            raise _error_from_exception(ev.error)
        text = "".join(parts)
        finish = (last.finish_reason if last else None) or "length"
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion", "created": created,
                "model": state.model_id, "choices": [choice], "usage": usage(job), "system_fingerprint": "fate-edge",
                "fate_edge": engine_figures(job)}

    def usage(job: Job) -> dict[str, int]:
        p = job.last.prompt_tokens if job.last else len(job.prompt)
        c = job.last.generation_tokens if job.last else 0
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def engine_figures(job: Job) -> dict[str, Any]:
        s, last = job.stats, job.last
        if s is None or last is None:
            return {}
        return {"prompt_tps": last.prompt_tps, "generation_tps": last.generation_tps, "expert_hit_rate": s.hit_rate,
                "expert_misses": s.misses, "bytes_read": s.demand_bytes + s.prefetch_bytes + s.wasted_bytes,
                "stall_s": s.stall_s, "peak_rss_bytes": last.peak_rss_bytes}

    async def stream(job: Job, first: Event, parsed, rid: str, created: int):
        chat = parsed.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None, role: bool = False) -> bytes:
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else \
                    ({} if text is None else {"content": text})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            data: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": state.model_id,
                                    "system_fingerprint": "fate-edge", "choices": [choice]}
            if parsed.include_usage:
                data["usage"] = None
            return sse(data)

        ev = first
        try:
            if chat:
                yield chunk(None, None, role=True)
            while True:
                if ev.kind == "token":
                    step = ev.step
                    if step.text:
                        yield chunk(step.text, None)
                    if step.finish_reason is not None:
                        yield chunk(None, step.finish_reason)
                elif ev.kind == "error":
                    yield sse(_error_from_exception(ev.error).body())
                    return  # no [DONE]: the stream ended in an error
                else:
                    if job.last is not None and job.last.finish_reason is None:  # ended without a final token
                        yield chunk(None, "length")
                    if parsed.include_usage:
                        yield sse({"id": rid, "object": obj, "created": created, "model": state.model_id,
                                   "system_fingerprint": "fate-edge", "choices": [], "usage": usage(job),
                                   "fate_edge": engine_figures(job)})
                    yield b"data: [DONE]\n\n"
                    return
                ev = await job.queue.get()
        finally:
            job.cancel.set()  # the client went away (or we are done): stop generating before the next token

    return app


def sse(data: dict[str, Any]) -> bytes:
    import json

    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
