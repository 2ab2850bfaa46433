"""OpenAI request bodies → a prompt and a :class:`GenerateConfig`, with a clear 400 for anything off.

Validation is explicit rather than schema-driven so each message names the parameter, the value's
problem and what to send instead; unknown top-level keys are ignored (clients add new ones often).
"""

from __future__ import annotations

import builtins
import json
import math
from dataclasses import dataclass, field
from typing import Any, overload

from fate_edge.apps.server.errors import APIError, invalid, unsupported
from fate_edge.apps.server.response_format import response_format_grammar
from fate_edge.apps.server.tool_calls import parse_tools, tool_message
from fate_edge.runtime.generate import GenerateConfig
from fate_edge.runtime.sampling import SamplingParams
from fate_edge.runtime.token_logprobs import MAX_TOP_LOGPROBS

MAX_STOP = 16
MAX_N = 16  # choices per request (each is a sequence in the batch)
MAX_PROMPTS = 64  # prompts in one completions request (lm-eval's --batch_size sends several)
ROLES = {"system", "developer", "user", "assistant"}


@dataclass
class ParsedRequest:
    kind: str  # "chat" | "completion"
    model: str | None
    prompt: str | list[int]
    config: GenerateConfig
    stream: bool = False
    include_usage: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    n: int = 1  # choices, decoded together as n sequences of the batch
    logprobs: int | None = None  # None: off; else the top alternatives per token (0: the chosen token's alone)
    echo: bool = False  # completions: the prompt first in the text, with its tokens' logprobs when asked
    prompts: list[str | list[int]] = field(
        default_factory=list
    )  # completions: every prompt of a batch (``prompt``: the first)


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Bytes → a JSON object, or a 400 naming what is wrong (UTF-8, JSON syntax, top-level type)."""
    if not raw.strip():
        raise invalid("the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(f"the request body is not valid UTF-8 (byte {exc.start}: {exc.reason})") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise invalid("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {_type(body)}")
    bad = _lone_surrogate(body)
    if bad is not None:
        raise invalid(
            f"'{bad}' holds a lone UTF-16 surrogate escape (such as \\ud800 without its pair), which is "
            "not text; send valid Unicode",
            bad,
            "invalid_value",
        )
    return body


def _lone_surrogate(body: dict[str, Any]) -> str | None:
    """Where (``messages[0].content``) a string holds a lone surrogate: JSON escapes allow them, UTF-8 does not,
    and the tokenizer fails on them. Walked with a stack, as the body may be deeply nested."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and _has_surrogate(value):
                return where
        elif isinstance(value, dict):
            for key, item in value.items():
                name = key if not _has_surrogate(key) else ascii(key)
                stack.append((item, f"{where}.{name}" if where else name))
        elif isinstance(value, list):
            stack.extend((item, f"{where}[{i}]") for i, item in enumerate(value))
    return None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def _type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object"


class _Body:
    def __init__(self, body: dict[str, Any]):
        self.body = body

    def has(self, name: str) -> bool:
        return self.body.get(name) is not None

    def get(self, name: str) -> Any:
        return self.body.get(name)

    @overload
    def int(
        self, name: str, default: builtins.int, lo: builtins.int | None = None, hi: builtins.int | None = None
    ) -> builtins.int: ...
    @overload
    def int(
        self, name: str, default: None, lo: builtins.int | None = None, hi: builtins.int | None = None
    ) -> builtins.int | None: ...
    def int(
        self, name: str, default: builtins.int | None, lo: builtins.int | None = None, hi: builtins.int | None = None
    ) -> builtins.int | None:
        v = self.body.get(name)
        if v is None:
            return default
        if isinstance(v, float) and v.is_integer() and abs(v) < 2**63:
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise invalid(f"'{name}' must be an integer, got {_type(v)}", name, "invalid_type")
        if lo is not None and v < lo:
            raise invalid(f"'{name}' must be >= {lo}, got {v}", name, "invalid_value")
        if hi is not None and v > hi:
            raise invalid(f"'{name}' must be <= {hi}, got {v}", name, "invalid_value")
        return v

    def num(
        self, name: str, default: float, lo: float, hi: float, lo_open: bool = False, hi_open: bool = False
    ) -> float:
        v = self.body.get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise invalid(f"'{name}' must be a number, got {_type(v)}", name, "invalid_type")
        v = float(v)
        if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo) or (hi_open and v == hi):
            rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
            raise invalid(f"'{name}' must be in {rng}, got {v:g}", name, "invalid_value")
        return v

    def bool(self, name: str, default: bool) -> bool:
        v = self.body.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise invalid(f"'{name}' must be a boolean, got {_type(v)}", name, "invalid_type")
        return v


def _logprobs(b: _Body, kind: str) -> int | None:
    """Chat: ``logprobs: true`` with ``top_logprobs: N``; completions: ``logprobs: N``. At most OpenAI's 20."""
    if kind == "chat":
        top = b.int("top_logprobs", None, 0, MAX_TOP_LOGPROBS)
        if not b.bool("logprobs", False):
            if top is not None:
                raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
            return None
        return top or 0
    return b.int("logprobs", None, 0, MAX_TOP_LOGPROBS)


def _reject_unsupported(b: _Body, kind: str) -> None:
    if kind == "chat":
        # tools and tool_choice: tool_calls.parse_tools; response_format: response_format.py; logprobs: _logprobs
        if b.get("functions") not in (None, []):
            raise unsupported("functions", "the legacy 'functions' (send 'tools')")
        if b.get("function_call") not in (None, "none"):
            raise unsupported("function_call", "the legacy 'function_call' (send 'tool_choice')")
        if b.get("audio") is not None or b.get("modalities") not in (None, ["text"]):
            raise unsupported("modalities", "audio output")
    else:
        if b.get("suffix") not in (None, ""):
            raise unsupported("suffix", "suffix (fill in the middle)")
        best_of = b.int("best_of", 1)
        if best_of != 1:
            raise unsupported("best_of", f"best_of={best_of}")
    for name in ("presence_penalty", "frequency_penalty"):
        if b.num(name, 0.0, -2.0, 2.0) != 0.0:
            raise unsupported(name, f"a non-zero {name} (use repetition_penalty)")
    bias = b.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise invalid(f"'logit_bias' must be an object, got {_type(bias)}", "logit_bias", "invalid_type")
        if bias:
            raise unsupported("logit_bias", "logit_bias")
    user = b.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid(f"'user' must be a string, got {_type(user)}", "user", "invalid_type")


def _stop(b: _Body) -> list[str]:
    stop = b.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or any(not isinstance(s, str) for s in stop):
        raise invalid(f"'stop' must be a string or an array of strings, got {_type(stop)}", "stop", "invalid_type")
    if len(stop) > MAX_STOP:
        raise invalid(f"'stop' may hold at most {MAX_STOP} strings, got {len(stop)}", "stop", "invalid_value")
    if any(s == "" for s in stop):
        raise invalid("'stop' strings must not be empty", "stop", "invalid_value")
    return stop


def _config(b: _Body, context: int, default_max_tokens: int | None, least: int = 1) -> GenerateConfig:
    max_tokens = b.int("max_tokens", None, least, context)
    max_completion = b.int("max_completion_tokens", None, least, context)
    chosen = max_completion if max_completion is not None else max_tokens
    if chosen is None and default_max_tokens is not None:  # None: until end of text or the engine's context
        chosen = min(default_max_tokens, context)
    seed = b.int("seed", None, -(2**63), 2**64 - 1)
    sampling = SamplingParams(
        temperature=b.num("temperature", 1.0, 0.0, 2.0),  # OpenAI's default; 0 is greedy
        top_k=b.int("top_k", 0, 0, 1 << 30),
        top_p=b.num("top_p", 1.0, 0.0, 1.0, lo_open=True),
        min_p=b.num("min_p", 0.0, 0.0, 1.0, hi_open=True),
        repetition_penalty=b.num("repetition_penalty", 1.0, 0.0, 10.0, lo_open=True),
        seed=None if seed is None else seed % 2**63,
    )
    return GenerateConfig(
        max_tokens=chosen,
        sampling=sampling,
        stop=_stop(b),
        ignore_eos=b.bool("ignore_eos", False),
        cache_prompt=b.bool("cache_prompt", True),  # llama-server's name: false opts out of the prompt cache
    )


def _stream(b: _Body) -> tuple[bool, bool]:
    stream = b.bool("stream", False)
    opts = b.get("stream_options")
    if opts is None:
        return stream, False
    if not isinstance(opts, dict):
        raise invalid(f"'stream_options' must be an object, got {_type(opts)}", "stream_options", "invalid_type")
    if not stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")
    usage = opts.get("include_usage", False)
    if not isinstance(usage, bool):
        raise invalid(
            f"'stream_options.include_usage' must be a boolean, got {_type(usage)}",
            "stream_options.include_usage",
            "invalid_type",
        )
    return stream, usage


def _model(b: _Body) -> str | None:
    model = b.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid(f"'model' must be a string, got {_type(model)}", "model", "invalid_type")
    return model


def _content(i: int, content: Any) -> str:
    param = f"messages[{i}].content"
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise invalid(f"'{param}[{j}]' must be an object with a 'type'", param, "invalid_type")
            if part["type"] != "text":
                raise unsupported(param, f"content of type '{part['type']}' (this model reads text only)")
            if not isinstance(part.get("text"), str):
                raise invalid(f"'{param}[{j}].text' must be a string", param, "invalid_type")
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        raise invalid(f"'{param}' is required", param, "missing_required_parameter")
    raise invalid(f"'{param}' must be a string or an array of text parts, got {_type(content)}", param, "invalid_type")


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if messages is None:
        raise invalid("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(messages, list):
        raise invalid(f"'messages' must be an array, got {_type(messages)}", "messages", "invalid_type")
    if not messages:
        raise invalid("'messages' must hold at least one message", "messages", "invalid_value")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise invalid(f"'messages[{i}]' must be an object, got {_type(m)}", f"messages[{i}]", "invalid_type")
        role = m.get("role")
        if not isinstance(role, str):
            raise invalid(f"'messages[{i}].role' must be a string", f"messages[{i}].role", "invalid_type")
        if role == "tool" or (role == "assistant" and m.get("tool_calls")):  # tool calling (tool_calls.py)
            out.append(tool_message(i, m, out[-1] if out else None))
            continue
        if role == "function":
            raise unsupported(f"messages[{i}].role", "the legacy 'function' role (send 'tool' messages)")
        if role not in ROLES:
            raise invalid(
                f"'messages[{i}].role' must be one of {', '.join(sorted(ROLES))}; got '{role}'",
                f"messages[{i}].role",
                "invalid_value",
            )
        out.append({"role": "system" if role == "developer" else role, "content": _content(i, m.get("content"))})
    return out


def completion_prompt(body: dict[str, Any], vocab_size: int) -> str | list[int]:
    prompt = body.get("prompt")
    if prompt is None:
        raise invalid("'prompt' is required", "prompt", "missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("'prompt' is empty; send at least one character", "prompt", "invalid_value")
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise invalid("'prompt' is empty; send at least one token", "prompt", "invalid_value")
        if all(isinstance(t, str) for t in prompt):
            raise unsupported("prompt", "a batch of several prompts")
        if all(isinstance(t, list) for t in prompt):
            raise unsupported("prompt", "a batch of several prompts")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in prompt):
            raise invalid(
                "'prompt' must be a string, an array of token ids or an array of one of those", "prompt", "invalid_type"
            )
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise invalid(
                f"'prompt' holds token id {bad[0]} outside the vocabulary [0, {vocab_size})", "prompt", "invalid_value"
            )
        return list(prompt)
    raise invalid(f"'prompt' must be a string or an array of token ids, got {_type(prompt)}", "prompt", "invalid_type")


def completion_prompts(body: dict[str, Any], vocab_size: int) -> list[str | list[int]]:
    """A completions ``prompt``: one (a string or token ids) or a batch of them (strings or arrays of token ids)."""
    prompt = body.get("prompt")
    batch = (
        isinstance(prompt, list)
        and len(prompt) > 1
        and (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt))
    )
    if not batch:
        return [completion_prompt(body, vocab_size)]
    assert isinstance(prompt, list)
    if len(prompt) > MAX_PROMPTS:
        raise invalid(f"'prompt' may hold at most {MAX_PROMPTS} prompts, got {len(prompt)}", "prompt", "invalid_value")
    out = []
    for i, p in enumerate(prompt):
        try:
            out.append(completion_prompt({"prompt": p}, vocab_size))
        except APIError as exc:
            raise invalid(f"'prompt[{i}]': {exc.message}", "prompt", exc.code) from None
    return out


def parse_request(
    kind: str,
    body: dict[str, Any],
    context: int,
    vocab_size: int,
    default_max_tokens: int | None,
    render_chat,
    chat_template: str | None = None,
) -> ParsedRequest:
    """Validate an OpenAI chat or completion body; ``render_chat(messages, **kw) -> str`` applies the template
    (``chat_template``, its text, tells the tool-call syntax)."""
    b = _Body(body)
    model = _model(b)
    stream, include_usage = _stream(b)
    _reject_unsupported(b, kind)
    n = b.int("n", 1, 1, MAX_N)
    assert n is not None
    logprobs = _logprobs(b, kind)
    config = _config(b, context, default_max_tokens, 1 if kind == "chat" else 0)  # completions: 0 with echo
    config.logprobs = logprobs
    config.grammar = response_format_grammar(body)  # structured output: None for free text
    extra: dict[str, Any] = {}
    if kind == "chat":
        tools = extra["tools"] = parse_tools(body, chat_template)
        if tools is not None and tools.grammar is not None:  # a forced call: its grammar wins over response_format
            config.grammar = tools.grammar
        messages = chat_messages(body)
        try:
            prompt: str | list[int] = render_chat(messages, tools=tools.tools) if tools else render_chat(messages)
        except APIError:
            raise
        except Exception as exc:  # a template that rejects the conversation (raise_exception in jinja)
            raise invalid(f"the chat template rejected these messages: {exc}", "messages") from None
        prompts = [prompt]
    else:
        prompts = completion_prompts(body, vocab_size)
        prompt = prompts[0]
    echo = kind != "chat" and b.bool("echo", False)
    return ParsedRequest(
        kind, model, prompt, config, stream, include_usage, extra, n=n, logprobs=logprobs, echo=echo, prompts=prompts
    )
