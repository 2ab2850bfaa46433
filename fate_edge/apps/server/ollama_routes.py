"""Ollama's native API beside the OpenAI one, on the same engine and runner: ``/api/version``, ``/api/tags``,
``/api/show``, ``/api/ps``, ``/api/generate`` and ``/api/chat`` (NDJSON streams, or one object with
``"stream": false``). The local-exposure guards (Host, Origin, API key, JSON bodies) are the OpenAI routes'; every
error, theirs included, has Ollama's shape ``{"error": "..."}`` under ``/api/`` (app.py)."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from fate_edge.apps.server.errors import APIError, Disconnected, OllamaError, QueueFull, error_from_exception
from fate_edge.apps.server.ollama_protocol import bad, chat_messages, common, config_of, generate_prompt
from fate_edge.apps.server.request_helpers import DisconnectWatch, check_auth, read_json, ready_engine
from fate_edge.apps.server.runner import Event, Failed, Job, Token
from fate_edge.apps.server.state import ServerState, state_of
from fate_edge.runtime.generate import check_context
from fate_edge.version import __version__

router = APIRouter()
NDJSON = "application/x-ndjson"


def ollama_name(state: ServerState) -> str:
    return state.model_id if ":" in state.model_id else f"{state.model_id}:latest"


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _check_model(state: ServerState, name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise bad('"model" is required (a string)')
    if name not in (state.model_id, ollama_name(state)):
        raise OllamaError(404, f'model "{name}" not found; this server serves "{ollama_name(state)}"')
    return name


def _details(eng: Any) -> dict[str, Any]:
    cfg = eng.model.config if eng is not None else None
    family = getattr(cfg, "model_type", "") if cfg is not None else ""
    bits = getattr(getattr(eng, "policy", None), "bits", 16)
    return {
        "parent_model": "",
        "format": "fate-edge",
        "family": family,
        "families": [family] if family else None,
        "parameter_size": "",
        "quantization_level": "BF16" if bits == 16 else f"Q{bits}",
    }


def _store_bytes(eng: Any) -> int:
    path = getattr(getattr(eng, "store", None), "path", None)
    if path is None:
        return 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _card(state: ServerState) -> dict[str, Any]:
    eng = state.engine
    return {
        "name": ollama_name(state),
        "model": ollama_name(state),
        "modified_at": datetime.fromtimestamp(state.started, timezone.utc).isoformat(),
        "size": _store_bytes(eng) if eng is not None else 0,
        "digest": "",
        "details": _details(eng),
    }


@router.api_route("/", methods=["GET", "HEAD"])
async def root(request: Request):
    """Ollama's heartbeat (its Go client sends ``HEAD /`` first): open like ``/health``."""
    return PlainTextResponse("fate-edge is running")


@router.get("/api/version")
async def version(request: Request):
    check_auth(request)
    return {"version": __version__}


@router.get("/api/tags")
async def tags(request: Request):
    check_auth(request)
    state = state_of(request)
    return {"models": [await run_in_threadpool(_card, state)]}


@router.get("/api/ps")
async def ps(request: Request):
    check_auth(request)
    state = state_of(request)
    if state.engine is None:
        return {"models": []}
    card = await run_in_threadpool(_card, state)
    card.update(expires_at="2262-04-11T23:47:16.854775807Z", size_vram=0)  # loaded until the daemon stops
    card["size"] = int(state.engine.budget)
    return {"models": [card]}


@router.post("/api/show")
async def show(request: Request):
    check_auth(request)
    state = state_of(request)
    body = await read_json(request)
    _check_model(state, body.get("model", body.get("name")))
    eng = ready_engine(request)
    cfg = eng.model.config
    arch = cfg.model_type
    return {
        "modelfile": f"# served by fate-edge {__version__}\nFROM {state.model_id}\n",
        "parameters": "",
        "template": eng.tokenizer.chat_template or "",
        "details": _details(eng),
        "model_info": {
            "general.architecture": arch,
            f"{arch}.context_length": cfg.max_position_embeddings,
            f"{arch}.embedding_length": cfg.hidden_size,
            f"{arch}.block_count": cfg.num_hidden_layers,
            f"{arch}.expert_count": cfg.num_experts,
            f"{arch}.expert_used_count": cfg.num_experts_per_tok,
        },
        "capabilities": ["completion"],
        "modified_at": datetime.fromtimestamp(state.started, timezone.utc).isoformat(),
    }


@router.post("/api/generate")
async def api_generate(request: Request):
    return await _run(request, "generate")


@router.post("/api/chat")
async def api_chat(request: Request):
    return await _run(request, "chat")


@router.post("/api/pull")
@router.post("/api/push")
@router.post("/api/create")
@router.post("/api/copy")
@router.delete("/api/delete")
async def manage(request: Request):
    check_auth(request)
    raise OllamaError(
        501,
        f"{request.url.path} is not supported by fate-edge: it serves the one model it was started with "
        "(fate-edge serve --model NAME finds a model Ollama already pulled)",
    )


@router.post("/api/embed")
@router.post("/api/embeddings")
async def embed(request: Request):
    check_auth(request)
    raise bad(f'{request.url.path}: "{ollama_name(state_of(request))}" does not support embeddings')


async def _run(request: Request, kind: str) -> Any:
    t0 = time.perf_counter()
    state = state_of(request)
    check_auth(request)
    eng = ready_engine(request)
    body = await read_json(request)
    model, stream = common(body)
    _check_model(state, model)
    context = eng.model.config.max_position_embeddings
    config = config_of(body, context)

    def prepare() -> list[int]:
        if kind == "chat":
            prompt = eng.tokenizer.apply_chat_template(chat_messages(body))
        else:
            prompt = generate_prompt(body, eng.tokenizer.apply_chat_template)
        return eng.tokenizer.encode(prompt) if prompt else []

    try:
        ids = await run_in_threadpool(prepare)
    except OllamaError:
        raise
    except Exception as exc:  # a template that rejects the conversation (raise_exception in jinja)
        raise bad(f"the chat template rejected these messages: {exc}") from None
    if not ids:  # Ollama answers an empty prompt by loading the model: done at once
        done = _final(model, kind, "load", None, t0, 0)
        return _ndjson_once(done) if stream else done
    try:
        check_context(len(ids), min(context, config.context_limit or context))
    except Exception as exc:
        raise error_from_exception(exc, "prompt") from None
    job = Job(ids, config, asyncio.get_running_loop())
    runner = state.runner
    assert runner is not None  # made with the engine, which ready_engine found
    try:
        runner.submit(job)
    except QueueFull as exc:
        raise OllamaError(503, f"server busy: {exc}; retry later", {"Retry-After": "1"}) from None
    watch = DisconnectWatch(request)
    try:
        first = await watch.next_event(job)
        if isinstance(first, Failed):
            raise error_from_exception(first.error, "prompt")
        state.metrics.first_token(f"/api/{kind}", time.perf_counter() - t0)
        if stream:
            return StreamingResponse(_stream(job, first, model, kind, t0), media_type=NDJSON)
        parts: list[str] = []
        ev: Event = first
        while isinstance(ev, Token):
            parts.append(ev.step.text)
            ev = await watch.next_event(job)
        if isinstance(ev, Failed):
            raise error_from_exception(ev.error, "prompt")
        return _final(model, kind, _reason(job), job, t0, len(ids), "".join(parts))
    except Disconnected:
        return Response(status_code=499)
    finally:
        watch.stop()
        if not stream:
            job.cancel.set()


def _reason(job: Job) -> str:
    return (job.last.finish_reason if job.last is not None else None) or "length"


def _piece(model: str, kind: str, text: str) -> dict[str, Any]:
    out: dict[str, Any] = {"model": model, "created_at": _now()}
    if kind == "chat":
        out["message"] = {"role": "assistant", "content": text}
    else:
        out["response"] = text
    out["done"] = False
    return out


def _final(model: str, kind: str, reason: str, job: Job | None, t0: float, prompt_tokens: int, text: str = "") -> dict:
    out = _piece(model, kind, text)
    last = job.last if job is not None else None
    n = last.generation_tokens if last is not None else 0
    prompt_s = prompt_tokens / last.prompt_tps if last is not None and last.prompt_tps > 0 else 0.0
    eval_s = n / last.generation_tps if last is not None and last.generation_tps > 0 else 0.0
    out.update(
        done=True,
        done_reason=reason,
        total_duration=int((time.perf_counter() - t0) * 1e9),
        load_duration=0,  # the model stays loaded for the daemon's life
        prompt_eval_count=prompt_tokens,
        prompt_eval_duration=int(prompt_s * 1e9),
        eval_count=n,
        eval_duration=int(eval_s * 1e9),
    )
    return out


def _line(data: dict[str, Any]) -> bytes:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def _ndjson_once(data: dict[str, Any]) -> Response:
    return Response(_line(data), media_type=NDJSON)


async def _stream(job: Job, first: Event, model: str, kind: str, t0: float):
    ev = first
    try:
        while True:
            if isinstance(ev, Token):
                if ev.step.text:
                    yield _line(_piece(model, kind, ev.step.text))
            elif isinstance(ev, Failed):
                yield _line({"error": error_from_exception(ev.error).message})
                return
            else:
                yield _line(_final(model, kind, _reason(job), job, t0, len(job.prompt)))
                return
            ev = await job.queue.get()
    finally:
        job.cancel.set()


def ollama_error(exc: APIError | OllamaError) -> JSONResponse:
    """Any error of a route under ``/api/`` in Ollama's shape (its status and headers kept)."""
    if isinstance(exc, OllamaError):
        return exc.response()
    return JSONResponse({"error": exc.message}, status_code=exc.status, headers=exc.headers)


__all__ = ["OllamaError", "ollama_error", "router"]
