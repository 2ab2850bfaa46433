"""Ollama request bodies (``/api/generate``, ``/api/chat``) → a prompt and a :class:`GenerateConfig`.

Errors have Ollama's shape, ``{"error": "..."}``, with the status Ollama gives (400 for a bad field, 404 for an
unknown model, 501 for what this server does not do). ``options`` of the wrong type are refused naming the option
(Ollama's own daemon does the same); options it does not know, or that tune its llama.cpp runner (``num_gpu``,
``num_thread``, ``mirostat`` ...), are ignored, as Ollama ignores unknown ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fate_edge.apps.server.errors import OllamaError
from fate_edge.errors import GrammarError
from fate_edge.runtime.generate import GenerateConfig
from fate_edge.runtime.sampling import SamplingParams
from fate_edge.runtime.structured import json_schema_grammar

# Ollama's defaults where a Modelfile sets none (its api/types.go DefaultOptions); its repeat_penalty of 1.1 over
# the last 64 tokens is left out: ours would cover the whole history, so the penalty is off unless asked for.
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.0, "repeat_penalty": 1.0}
MAX_STOP = 16


def bad(message: str) -> OllamaError:
    return OllamaError(400, message)


def not_done(what: str, why: str) -> OllamaError:
    """A request feature this server does not do: a 400 (as Ollama's for a model without the capability), one line
    saying why."""
    return OllamaError(400, f"{what} is not supported by fate-edge: {why}")


@dataclass
class OllamaRequest:
    model: str
    prompt: str | list[int]
    config: GenerateConfig
    stream: bool


def _number(options: dict[str, Any], name: str, lo: float, hi: float) -> float | None:
    v = options.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(f'option "{name}" must be of type number, got {type(v).__name__} {v!r}')
    if not math.isfinite(v) or not lo <= v <= hi:
        raise bad(f'option "{name}" must be in [{lo:g}, {hi:g}], got {v}')
    return float(v)


def _integer(options: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    v = options.get(name)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f'option "{name}" must be of type integer, got {type(v).__name__} {v!r}')
    if not lo <= v <= hi:
        raise bad(f'option "{name}" must be in [{lo}, {hi}], got {v}')
    return v


def _cache_prompt(body: dict[str, Any], options: dict[str, Any]) -> bool:
    """``cache_prompt`` (llama-server's name) in ``options`` or the body: False opts out of the prompt cache."""
    for where, d in (("option ", options), ("", body)):
        v = d.get("cache_prompt")
        if v is not None:
            if not isinstance(v, bool):
                raise bad(f'{where}"cache_prompt" must be of type boolean, got {type(v).__name__} {v!r}')
            return v
    return True


def _stops(options: dict[str, Any]) -> list[str]:
    stop = options.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or any(not isinstance(s, str) or not s for s in stop):
        raise bad('option "stop" must be of type array of non-empty strings')
    if len(stop) > MAX_STOP:
        raise bad(f'option "stop" may hold at most {MAX_STOP} strings, got {len(stop)}')
    return stop


def config_of(body: dict[str, Any], context: int) -> GenerateConfig:
    options = body.get("options")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise bad(f'"options" must be an object, got {type(options).__name__}')
    got = {
        "temperature": _number(options, "temperature", 0.0, 100.0),
        "top_p": _number(options, "top_p", 0.0, 1.0),
        "min_p": _number(options, "min_p", 0.0, 1.0),
        "repeat_penalty": _number(options, "repeat_penalty", 0.0, 100.0),
        "top_k": _integer(options, "top_k", 0, 1 << 30),
    }
    o = {k: (DEFAULTS[k] if v is None else v) for k, v in got.items()}
    seed = _integer(options, "seed", -(2**63), 2**64 - 1)
    num_predict = _integer(options, "num_predict", -2, 1 << 30)
    num_ctx = _integer(options, "num_ctx", 1, 1 << 30)
    sampling = SamplingParams(
        temperature=o["temperature"],
        top_k=int(o["top_k"]),
        top_p=o["top_p"] if o["top_p"] > 0 else 1.0,  # Ollama: 0 turns it off
        min_p=min(o["min_p"], 0.999),
        repetition_penalty=o["repeat_penalty"] if o["repeat_penalty"] > 0 else 1.0,
        seed=None if seed is None or seed < 0 else seed % 2**63,  # Ollama: -1 is a random seed
    )
    # num_predict: -1 (default) until the end of text, -2 until the context is full: both are our None
    max_tokens = None if num_predict is None or num_predict < 0 else num_predict
    if max_tokens is not None:
        max_tokens = min(max_tokens, context)
    return GenerateConfig(
        max_tokens=max_tokens,
        sampling=sampling,
        stop=_stops(options),
        context_limit=min(num_ctx or context, context),
        grammar=format_grammar(body),
        cache_prompt=_cache_prompt(body, options),
    )


def format_grammar(body: dict[str, Any]) -> str | None:
    """``format``: "json" (any JSON object) or a JSON schema, enforced by grammar-constrained sampling
    (runtime.structured, as the OpenAI routes' ``response_format``); absent or "": free text."""
    fmt = body.get("format")
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return json_schema_grammar(None)
    if not isinstance(fmt, dict):
        raise bad(f'"format" must be "json" or a JSON schema object, got {str(fmt)[:40]!r}')
    try:
        return json_schema_grammar(fmt)
    except GrammarError as exc:
        raise bad(f'"format" is not a JSON schema the grammar library accepts: {exc}') from None


def common(body: dict[str, Any]) -> tuple[str, bool]:
    """The model name and ``stream`` (true unless false), and refusals shared by generate and chat."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad('"model" is required (a string)')
    stream = body.get("stream", True)
    if stream is None:
        stream = True
    if not isinstance(stream, bool):
        raise bad(f'"stream" must be a boolean, got {type(stream).__name__}')
    if body.get("think") not in (None, False):
        raise bad(f'"{model}" does not support thinking')
    if body.get("tools"):
        raise not_done('"tools"', "tool calling is not built yet")
    keep_alive = body.get("keep_alive")
    if keep_alive is not None and not isinstance(keep_alive, (str, int, float)):
        raise bad('"keep_alive" must be a duration string ("5m") or a number of seconds')
    return model, stream


def generate_prompt(body: dict[str, Any], render_chat) -> str:
    """``/api/generate``'s prompt: as given with ``raw``, else through the chat template as one user turn."""
    prompt = body.get("prompt", "")
    if prompt is None:
        prompt = ""
    if not isinstance(prompt, str):
        raise bad(f'"prompt" must be a string, got {type(prompt).__name__}')
    if body.get("images"):
        raise not_done('"images"', "this model reads text only")
    if body.get("suffix"):
        raise not_done('"suffix"', "fill-in-the-middle templates are not built")
    if body.get("context"):
        raise not_done('"context"', "it is deprecated in Ollama; send the conversation to /api/chat")
    raw = body.get("raw", False)
    if not isinstance(raw, bool):
        raise bad(f'"raw" must be a boolean, got {type(raw).__name__}')
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise bad('"system" must be a string')
    if raw:
        return prompt
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return render_chat(messages)


def chat_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if messages is None:
        messages = []
    if not isinstance(messages, list):
        raise bad(f'"messages" must be an array, got {type(messages).__name__}')
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f'"messages[{i}]" must be an object with a string "role"')
        role, content = m["role"], m.get("content", "")
        if role not in ("system", "user", "assistant"):
            if role == "tool":
                raise not_done(f'"messages[{i}].role" "tool"', "tool calling is not built yet")
            raise bad(f'"messages[{i}].role" must be system, user or assistant, got "{role}"')
        if m.get("images"):
            raise not_done(f'"messages[{i}].images"', "this model reads text only")
        if m.get("tool_calls"):
            raise not_done(f'"messages[{i}].tool_calls"', "tool calling is not built yet")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad(f'"messages[{i}].content" must be a string')
        out.append({"role": role, "content": content})
    return out
