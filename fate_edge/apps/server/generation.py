"""One generation request, chat or text completion: validate, queue the job, answer as JSON or SSE.

A request whose client disconnects is stopped before its next token (or dropped from the queue if it
had not started), streaming or not, and counted in ``fate_edge_requests_cancelled_total``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from fate_edge.apps.server.errors import APIError, Disconnected, QueueFull, error_from_exception, invalid
from fate_edge.apps.server.protocol import ParsedRequest, parse_request
from fate_edge.apps.server.request_helpers import DisconnectWatch, check_auth, read_json, ready_engine
from fate_edge.apps.server.runner import Event, Failed, Job, Token
from fate_edge.apps.server.state import ServerState, state_of
from fate_edge.apps.server.tool_calls import ToolStream, parse_calls
from fate_edge.runtime.generate import GenerationResponse, check_context


async def generate(request: Request, kind: str) -> Any:
    t0 = time.perf_counter()
    state = state_of(request)
    check_auth(request)
    eng = ready_engine(request)
    body = await read_json(request)
    model_name = body.get("model")
    if isinstance(model_name, str) and model_name != state.model_id:
        raise APIError(
            404,
            f"model '{model_name}' not found; this server serves '{state.model_id}'",
            "not_found_error",
            "model",
            "model_not_found",
        )
    context = eng.model.config.max_position_embeddings
    prompt_param = "messages" if kind == "chat" else "prompt"

    def prepare() -> tuple[ParsedRequest, list[int]]:
        parsed = parse_request(
            kind,
            body,
            context,
            eng.tokenizer.vocab_size,
            state.settings.default_max_tokens,
            eng.tokenizer.apply_chat_template,
            eng.tokenizer.chat_template,
        )
        ids = eng.tokenizer.encode(parsed.prompt) if isinstance(parsed.prompt, str) else parsed.prompt
        return parsed, ids

    parsed, ids = await run_in_threadpool(prepare)
    if not ids:
        raise invalid("the prompt encodes to no tokens; send some text", prompt_param)
    try:
        check_context(len(ids), context)
    except Exception as exc:
        raise error_from_exception(exc, prompt_param) from None
    job = Job(ids, parsed.config, asyncio.get_running_loop())
    runner = state.runner
    assert runner is not None  # made with the engine, which ready_engine found
    try:
        runner.submit(job)
    except QueueFull as exc:
        raise APIError(
            429,
            f"the server is busy: {exc}; retry later",
            "unavailable_error",
            None,
            "queue_full",
            headers={"Retry-After": "1"},
        ) from None
    watch = DisconnectWatch(request)
    try:
        return await _answer(state, job, parsed, watch, t0, prompt_param)
    except Disconnected:
        return Response(status_code=499)
    finally:
        watch.stop()
        if not parsed.stream:
            job.cancel.set()  # no-op once finished; stops the worker if this handler is cancelled


async def _answer(
    state: ServerState, job: Job, parsed: ParsedRequest, watch: DisconnectWatch, t0: float, prompt_param: str
) -> Any:
    chat = parsed.kind == "chat"
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    try:
        first = await watch.next_event(job)
    except BaseException:
        job.cancel.set()
        raise
    if isinstance(first, Failed):
        raise error_from_exception(first.error, prompt_param)
    state.metrics.first_token("/v1/chat/completions" if chat else "/v1/completions", time.perf_counter() - t0)
    if parsed.stream:  # from here the response watches the client itself (a failed send ends the stream)
        return StreamingResponse(
            _stream(state, job, first, parsed, rid, created),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    parts: list[str] = []
    last: GenerationResponse | None = None
    ev: Event = first
    while isinstance(ev, Token):
        parts.append(ev.step.text)
        last = ev.step
        ev = await watch.next_event(job)
    if isinstance(ev, Failed):
        raise error_from_exception(ev.error, prompt_param)
    text = "".join(parts)
    finish = (last.finish_reason if last else None) or "length"
    if chat:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        tools = parsed.extra.get("tools")
        if tools is not None:  # the calls the answer makes, as OpenAI's tool_calls
            content, calls = parse_calls(tools, text)
            if calls:
                message = {"role": "assistant", "content": content or None, "tool_calls": calls}
                finish = "tool_calls"
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": state.model_id,
        "choices": [choice],
        "usage": _usage(job),
        "system_fingerprint": "fate-edge",
        "fate_edge": _engine_figures(job),
    }


def _usage(job: Job) -> dict[str, int]:
    p = job.last.prompt_tokens if job.last else len(job.prompt)
    c = job.last.generation_tokens if job.last else 0
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _engine_figures(job: Job) -> dict[str, Any]:
    s, last = job.stats, job.last
    if s is None or last is None:
        return {}
    return {
        "prompt_tps": last.prompt_tps,
        "generation_tps": last.generation_tps,
        "expert_hit_rate": s.hit_rate,
        "expert_misses": s.misses,
        "bytes_read": s.demand_bytes + s.prefetch_bytes + s.wasted_bytes,
        "stall_s": s.stall_s,
        "peak_rss_bytes": last.peak_rss_bytes,
    }


async def _stream(state: ServerState, job: Job, first: Event, parsed: ParsedRequest, rid: str, created: int):
    chat = parsed.kind == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None, role: bool = False) -> bytes:
        if chat:
            delta: dict[str, Any] = (
                {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            )
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        data: dict[str, Any] = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": state.model_id,
            "system_fingerprint": "fate-edge",
            "choices": [choice],
        }
        if parsed.include_usage:
            data["usage"] = None
        return sse(data)

    tools = ToolStream(parsed.extra["tools"]) if parsed.extra.get("tools") is not None else None

    def tool_chunk(delta: dict[str, Any]) -> bytes:
        data: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": state.model_id}
        data["system_fingerprint"] = "fate-edge"
        data["choices"] = [{"index": 0, "delta": {"tool_calls": [delta]}, "logprobs": None, "finish_reason": None}]
        if parsed.include_usage:
            data["usage"] = None
        return sse(data)

    ev = first
    try:
        if chat:
            yield chunk(None, None, role=True)
        while True:
            if isinstance(ev, Token):
                step = ev.step
                text, finish, called = step.text, step.finish_reason, False
                deltas: list[dict[str, Any]] = []
                if tools is not None:  # text that may be a tool call is held, and sent as tool_calls deltas
                    text, deltas = tools.feed(text)
                    if finish is not None:
                        rest, last_deltas, called = tools.finish()
                        text, deltas = text + rest, deltas + last_deltas
                if text:
                    yield chunk(text, None)
                for delta in deltas:
                    yield tool_chunk(delta)
                if finish is not None:
                    yield chunk(None, "tool_calls" if called and finish == "stop" else finish)
            elif isinstance(ev, Failed):
                yield sse(error_from_exception(ev.error).body())
                return  # no [DONE]: the stream ended in an error
            else:
                if job.last is not None and job.last.finish_reason is None:  # ended without a final token
                    yield chunk(None, "length")
                if parsed.include_usage:
                    yield sse(
                        {
                            "id": rid,
                            "object": obj,
                            "created": created,
                            "model": state.model_id,
                            "system_fingerprint": "fate-edge",
                            "choices": [],
                            "usage": _usage(job),
                            "fate_edge": _engine_figures(job),
                        }
                    )
                yield b"data: [DONE]\n\n"
                return
            ev = await job.queue.get()
    finally:
        job.cancel.set()  # the client went away (or we are done): stop generating before the next token


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
