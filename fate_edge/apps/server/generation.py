"""One generation request, chat or text completion: validate, queue the job, answer as JSON or SSE.

A request whose client disconnects is stopped before its next token (or dropped from the queue if it
had not started), streaming or not, and counted in ``fate_edge_requests_cancelled_total``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import replace
from typing import Any

from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from fate_edge.apps.server.errors import APIError, Disconnected, QueueFull, error_from_exception, invalid
from fate_edge.apps.server.logprobs import CompletionLogprobs, chat_entry, kv_room, merge, score_prompt
from fate_edge.apps.server.protocol import ParsedRequest, parse_request
from fate_edge.apps.server.request_helpers import DisconnectWatch, check_auth, read_json, ready_engine
from fate_edge.apps.server.runner import Event, Failed, Job, Token
from fate_edge.apps.server.state import ServerState, state_of
from fate_edge.apps.server.tool_calls import ToolStream, parse_calls
from fate_edge.runtime.generate import GenerateConfig, check_context
from fate_edge.runtime.token_logprobs import TokenLogprob
from fate_edge.sizes import format_bytes


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

    def prepare() -> tuple[ParsedRequest, list[list[int]]]:
        parsed = parse_request(
            kind,
            body,
            context,
            eng.tokenizer.vocab_size,
            state.settings.default_max_tokens,
            eng.tokenizer.apply_chat_template,
            eng.tokenizer.chat_template,
        )
        return parsed, [eng.tokenizer.encode(p) if isinstance(p, str) else p for p in parsed.prompts]

    parsed, all_ids = await run_in_threadpool(prepare)
    room, per_token = kv_room(eng)
    positions = 0
    for ids in all_ids:
        if not ids:
            raise invalid("the prompt encodes to no tokens; send some text", prompt_param)
        try:
            check_context(len(ids), context)
        except Exception as exc:
            raise error_from_exception(exc, prompt_param) from None
        answer = parsed.config.max_tokens
        if answer is None:
            answer = max(0, min(context, getattr(eng, "context_tokens", context)) - len(ids))
        positions += parsed.n * (len(ids) + answer)
    jobs_wanted = parsed.n * len(all_ids)
    if jobs_wanted > 1 and room and positions * per_token > room:
        param = "n" if len(all_ids) == 1 else "prompt"
        raise invalid(
            f"'{param}': {parsed.n} choice(s) of {len(all_ids)} prompt(s) need {positions} positions, "
            f"{format_bytes(positions * per_token)} of KV cache together, more than the budget's "
            f"{format_bytes(room)}; lower n, max_tokens or the prompts in the batch, or raise --context-tokens",
            param,
            "kv_room_exceeded",
        )
    runner = state.runner
    assert runner is not None  # made with the engine, which ready_engine found
    places = runner.slots + runner.max_queue
    if jobs_wanted > places:
        raise invalid(
            f"'prompt': {len(all_ids)} prompt(s) x n={parsed.n} are {jobs_wanted} sequences, more than this server "
            f"runs and queues at once ({places}: --max-batch plus --max-queue); send fewer per request",
            "prompt" if len(all_ids) > 1 else "n",
            "too_many_sequences",
        )
    echoes = []
    for ids, prompt in zip(all_ids, parsed.prompts):
        prompt_lp = None
        if parsed.echo and parsed.logprobs is not None:  # the prompt's own logprobs: one teacher-forced prefill
            try:
                prompt_lp = await run_in_threadpool(score_prompt, eng, ids, parsed.logprobs)
            except Exception as exc:
                raise error_from_exception(exc, prompt_param) from None
        echoes.append(Echo(parsed.echo, prompt, eng.tokenizer, ids, prompt_lp))
    loop = asyncio.get_running_loop()
    jobs = [Job(ids, _choice_config(parsed.config, i), loop) for ids in all_ids for i in range(parsed.n)]
    try:
        for job in jobs:
            runner.submit(job)
    except QueueFull as exc:
        for job in jobs:
            job.cancel.set()
        raise APIError(
            429,
            f"the server is busy: {exc}; retry later",
            "unavailable_error",
            None,
            "queue_full",
            headers={"Retry-After": "1"},
        ) from None
    group = Group(jobs, loop)
    watch = DisconnectWatch(request)
    try:
        return await _answer(state, group, parsed, watch, t0, prompt_param, echoes)
    except Disconnected:
        return Response(status_code=499)
    finally:
        watch.stop()
        if not parsed.stream:
            group.cancel.set()  # no-op once finished; stops the workers if this handler is cancelled


def _choice_config(config: GenerateConfig, i: int) -> GenerateConfig:
    """Choice ``i``'s config: a given seed moves on by the choice's index, so the n choices differ but repeat."""
    if i == 0 or config.sampling.seed is None:
        return config
    return replace(config, sampling=replace(config.sampling, seed=(config.sampling.seed + i) % 2**63))


async def _answer(
    state: ServerState,
    group: Group,
    parsed: ParsedRequest,
    watch: DisconnectWatch,
    t0: float,
    prompt_param: str,
    echoes: list[Echo],
) -> Any:
    chat = parsed.kind == "chat"
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    try:
        first = await watch.next_item(group)
    except BaseException:
        group.cancel.set()
        raise
    if isinstance(first[1], Failed):
        raise error_from_exception(first[1].error, prompt_param)
    state.metrics.first_token("/v1/chat/completions" if chat else "/v1/completions", time.perf_counter() - t0)
    if parsed.stream:  # from here the response watches the client itself (a failed send ends the stream)
        return StreamingResponse(
            _stream(state, group, first, parsed, rid, created, echoes),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    n = len(group.jobs)
    parts: list[list[str]] = [[] for _ in range(n)]
    lasts: list[Any] = [None] * n
    logprobs: list[list[Any]] = [[] for _ in range(n)]
    ended, item = 0, first
    while True:
        i, ev = item
        if isinstance(ev, Failed):
            raise error_from_exception(ev.error, prompt_param)
        if isinstance(ev, Token):
            parts[i].append(ev.step.text)
            lasts[i] = ev.step
            if ev.step.logprob is not None:
                logprobs[i].append(ev.step.logprob)
        else:
            ended += 1
            if ended == n:
                break
        item = await watch.next_item(group)
    choices = []
    tools = parsed.extra.get("tools")
    for i in range(n):
        echo = echoes[i // parsed.n]  # choices come prompt by prompt, n each (as OpenAI orders them)
        text = "".join(parts[i])
        finish = (lasts[i].finish_reason if lasts[i] else None) or "length"
        if chat:
            lp = None
            if parsed.logprobs is not None:
                lp = {"content": [chat_entry(echo.tokenizer, e) for e in logprobs[i]], "refusal": None}
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if tools is not None:  # the calls the answer makes, as OpenAI's tool_calls
                content, calls = parse_calls(tools, text)
                if calls:
                    message = {"role": "assistant", "content": content or None, "tool_calls": calls}
                    finish = "tool_calls"
            choice = {"index": i, "message": message, "logprobs": lp, "finish_reason": finish}
        else:
            lpc = echo.completion_logprobs(logprobs[i]) if parsed.logprobs is not None else None
            choice = {"index": i, "text": echo.text + text, "logprobs": lpc, "finish_reason": finish}
        choices.append(choice)
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": state.model_id,
        "choices": choices,
        "usage": _usage(group.jobs, parsed.n),
        "system_fingerprint": "fate-edge",
        "fate_edge": _engine_figures(group.jobs[0]),
    }


def _usage(jobs: list[Job], n: int = 1) -> dict[str, Any]:
    p = sum(len(job.prompt) for job in jobs[::n])  # each prompt once, however many choices (as OpenAI counts)
    c = sum(job.last.generation_tokens if job.last else 0 for job in jobs)
    # the prompt positions the prompt cache held (runtime.prompt_cache): OpenAI's cached_tokens
    cached = sum(job.last.cached_tokens if job.last else 0 for job in jobs[::n])
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


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


async def _stream(
    state: ServerState,
    group: Group,
    first: tuple[int, Event],
    parsed: ParsedRequest,
    rid: str,
    created: int,
    echoes: list[Echo],
):
    chat = parsed.kind == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"
    n = len(group.jobs)

    def chunk(i: int, text: str | None, finish: str | None, role: bool = False, lp: Any = None) -> bytes:
        if chat:
            delta: dict[str, Any] = (
                {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            )
            choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": i, "text": text or "", "logprobs": lp, "finish_reason": finish}
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

    spec = parsed.extra.get("tools")
    tools = [ToolStream(spec) for _ in range(n)] if spec is not None else None  # one per choice

    def tool_chunk(i: int, delta: dict[str, Any]) -> bytes:
        data: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": state.model_id}
        data["system_fingerprint"] = "fate-edge"
        data["choices"] = [{"index": i, "delta": {"tool_calls": [delta]}, "logprobs": None, "finish_reason": None}]
        if parsed.include_usage:
            data["usage"] = None
        return sse(data)

    echo_of = [echoes[i // parsed.n] for i in range(n)]  # choices come prompt by prompt, n each
    offsets = [len(e.text) for e in echo_of]  # completions' text_offset of each choice's next token
    item, ended, finished = first, 0, [False] * n
    try:
        for i in range(n):
            if chat:
                yield chunk(i, None, None, role=True)
            elif echo_of[i].text:  # echo: the prompt (and its logprobs) first
                yield chunk(i, echo_of[i].text, None, lp=echo_of[i].prompt_logprobs())
        while True:
            i, ev = item
            if isinstance(ev, Token):
                step = ev.step
                lp = None
                if step.logprob is not None:
                    if chat:
                        lp = {"content": [chat_entry(echo_of[i].tokenizer, step.logprob)], "refusal": None}
                    else:
                        cl = CompletionLogprobs(echo_of[i].tokenizer, offsets[i])
                        lp = cl.entries([step.logprob], [step.logprob.token])
                        offsets[i] = cl.offset  # as the whole answer counts them: token by token
                text, finish, called = step.text, step.finish_reason, False
                deltas: list[dict[str, Any]] = []
                if tools is not None:  # text that may be a tool call is held, and sent as tool_calls deltas
                    text, deltas = tools[i].feed(text)
                    if finish is not None:
                        rest, last_deltas, called = tools[i].finish()
                        text, deltas = text + rest, deltas + last_deltas
                if text or lp is not None:
                    yield chunk(i, text, None, lp=lp)
                for delta in deltas:
                    yield tool_chunk(i, delta)
                if finish is not None:
                    finished[i] = True
                    yield chunk(i, None, "tool_calls" if called and finish == "stop" else finish)
            elif isinstance(ev, Failed):
                yield sse(error_from_exception(ev.error).body())
                return  # no [DONE]: the stream ended in an error
            else:
                ended += 1
                job = group.jobs[i]
                if not finished[i] and (job.last is None or job.last.finish_reason is None):  # no final token
                    yield chunk(i, None, "length")
                if ended < n:
                    item = await group.queue.get()
                    continue
                if parsed.include_usage:
                    yield sse(
                        {
                            "id": rid,
                            "object": obj,
                            "created": created,
                            "model": state.model_id,
                            "system_fingerprint": "fate-edge",
                            "choices": [],
                            "usage": _usage(group.jobs, parsed.n),
                            "fate_edge": _engine_figures(group.jobs[0]),
                        }
                    )
                yield b"data: [DONE]\n\n"
                return
            item = await group.queue.get()
    finally:
        group.cancel.set()  # the client went away (or we are done): stop generating before the next token


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class _CancelAll:
    """``cancel.set()`` of a group: every choice's job stops."""

    def __init__(self, jobs: list[Job]):
        self.jobs = jobs

    def set(self) -> None:
        for job in self.jobs:
            job.cancel.set()


class Group:
    """A request's ``n`` jobs read as one: ``queue`` yields (choice index, event) in the order they come."""

    def __init__(self, jobs: list[Job], loop: asyncio.AbstractEventLoop):
        self.jobs = jobs
        self.cancel = _CancelAll(jobs)
        self.queue: asyncio.Queue = asyncio.Queue()
        self._tasks = [loop.create_task(self._forward(i, job)) for i, job in enumerate(jobs)]

    async def _forward(self, i: int, job: Job) -> None:
        while True:
            ev = await job.queue.get()
            self.queue.put_nowait((i, ev))
            if not isinstance(ev, Token):
                return


class Echo:
    """What ``echo`` puts before a completion: the prompt's text and, with ``logprobs``, its tokens' logprobs."""

    def __init__(
        self, echo: bool, prompt: str | list[int], tokenizer: Any, ids: list[int], prompt_lp: list[Any] | None
    ):
        self.tokenizer = tokenizer
        self.ids = ids
        self.prompt_lp = prompt_lp
        self.text = ""
        if echo:
            self.text = prompt if isinstance(prompt, str) else tokenizer.decode(ids)

    def prompt_logprobs(self) -> dict[str, Any] | None:
        if self.prompt_lp is None:
            return None
        return CompletionLogprobs(self.tokenizer).entries(self.prompt_lp, self.ids)

    def completion_logprobs(self, items: list[TokenLogprob]) -> dict[str, Any]:
        out = self.prompt_logprobs()
        more = CompletionLogprobs(self.tokenizer, len(self.text)).entries(list(items), [e.token for e in items])
        return merge(out, more)
