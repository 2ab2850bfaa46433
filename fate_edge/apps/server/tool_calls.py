"""OpenAI ``tools`` / ``tool_choice`` on chat: validation, the grammar of a forced call, and parsing the model's calls.

The model's own chat template renders the tools (``tools=`` passed to the template, as transformers does) and
teaches the syntax of a call; the syntax is read from the template's text:

- ``hermes`` (Hermes, Qwen): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``;
- ``llama`` (Llama 3.x JSON): ``{"name": ..., "parameters": {...}}``.

``tool_choice`` "required" or naming a function constrains the answer to such a call by a grammar (JSON schema of
the function's parameters, runtime.structured); "auto" lets the model choose and parses what it wrote; "none"
renders no tools.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from fate_edge.apps.server.errors import invalid, unsupported
from fate_edge.errors import GrammarError
from fate_edge.runtime.structured import json_schema_grammar, lark_grammar, lark_json, lark_literal

STYLES = ("hermes", "mistral", "llama")
ARGUMENT_PIECE = 16  # characters of arguments per streamed delta


@dataclass
class ToolSpec:
    style: str  # one of STYLES
    tools: list[dict[str, Any]]  # as the template gets them (OpenAI's shape)
    choice: str | None  # None: auto; "required"; or the name of the function to call
    grammar: str | None  # the forced call's grammar (choice given), else None


def tool_style(template: str | None) -> str | None:
    """Which call syntax ``template`` teaches, or None where it renders no tools."""
    if not template or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "parameters" in template:
        return "llama"
    return None


def _function(i: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise invalid(f'\'{where}\' must be an object like {{"type": "function", "function": {{...}}}}', where)
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
        raise invalid(
            f"'{where}.function.name' must be 1-64 letters, digits, '_', '.' or '-'", f"{where}.function.name"
        )
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise invalid(f"'{where}.function.parameters' must be a JSON schema object", f"{where}.function.parameters")
    try:
        json_schema_grammar(params)
    except GrammarError as exc:
        raise invalid(
            f"'{where}.function.parameters' is not a JSON schema the grammar library accepts: {exc}",
            f"{where}.function.parameters",
        ) from None
    return {"type": "function", "function": {**fn, "parameters": params}}


def _choice(choice: Any, names: list[str]) -> str | None:
    if choice is None or choice == "auto":
        return None
    if choice in ("none", "required"):
        return choice
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name in names:
            return name
        raise invalid(f"'tool_choice' names function '{name}', which is not in 'tools'", "tool_choice")
    raise invalid(
        '\'tool_choice\' must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def _call_schema(style: str, fn: dict[str, Any]) -> dict[str, Any]:
    key = "parameters" if style == "llama" else "arguments"
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, key: fn["parameters"]},
        "required": ["name", key],
        "additionalProperties": False,
    }


def forced_call_grammar(style: str, functions: list[dict[str, Any]]) -> str:
    """A grammar for one call to one of ``functions``, in ``style``'s syntax."""
    calls = " | ".join(f"c{i}" for i in range(len(functions)))
    rules = "".join(f"c{i}: {lark_json(_call_schema(style, fn))}\n" for i, fn in enumerate(functions))
    if style == "hermes":
        start = f"start: {lark_literal('<tool_call>')} {lark_literal(chr(10))} call {lark_literal(chr(10))} "
        start += lark_literal("</tool_call>")
    elif style == "mistral":  # the [TOOL_CALLS] marker is a special token the parser does not need
        start = 'start: "[" call "]"'
    else:
        start = "start: call"
    return lark_grammar(f"{start}\ncall: {calls}\n{rules}")


def parse_tools(body: dict[str, Any], template: str | None) -> ToolSpec | None:
    """The request's tools, validated; None where no tools are to be rendered (none given, or ``tool_choice``
    "none"). 400s name the field."""
    tools = body.get("tools")
    if tools is None or tools == []:
        if body.get("tool_choice") not in (None, "none", "auto"):
            raise invalid("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise invalid("'tools' must be an array of function tools", "tools")
    rendered = [_function(i, t) for i, t in enumerate(tools)]
    names = [t["function"]["name"] for t in rendered]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise invalid(f"'tools' names function '{name}' twice (tools[{i}]); names must be unique", "tools")
    choice = _choice(body.get("tool_choice"), names)
    if choice == "none":
        return None
    style = tool_style(template)
    if style is None:
        raise unsupported("tools", "tool calling with this model (its chat template renders no tools)")
    grammar = None
    if choice is not None:
        fns = [t["function"] for t in rendered if choice == "required" or t["function"]["name"] == choice]
        grammar = forced_call_grammar(style, fns)
    return ToolSpec(style, rendered, choice, grammar)


def tool_message(i: int, m: dict[str, Any], previous: dict[str, Any] | None) -> dict[str, Any]:
    """A ``tool`` message or an assistant message carrying ``tool_calls``, as chat templates read them (arguments as
    an object, which templates serialise with ``tojson``); ``previous`` is the message before it."""
    if m.get("role") == "tool":
        if previous is None or not (previous["role"] == "tool" or previous.get("tool_calls")):
            raise invalid(
                f"'messages[{i}]': a 'tool' message must answer an assistant message with 'tool_calls'",
                f"messages[{i}].role",
            )
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            raise invalid(f"'messages[{i}].content' must be a string", f"messages[{i}].content")
        return {"role": "tool", "content": content, "tool_call_id": m.get("tool_call_id")}
    calls = []
    for j, call in enumerate(m["tool_calls"]):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid(f"'messages[{i}].tool_calls[{j}]' must hold a function with a name", f"messages[{i}]")
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            raise invalid(
                f"'messages[{i}].tool_calls[{j}].function.arguments' is not JSON", f"messages[{i}].tool_calls"
            ) from None
        calls.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    content = m.get("content")
    return {"role": "assistant", "content": content if isinstance(content, str) else "", "tool_calls": calls}


def _call(obj: Any, names: set[str]) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)},
    }


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def parse_calls(spec: ToolSpec, text: str) -> tuple[str, list[dict[str, Any]]]:
    """``text`` split into its content and the OpenAI ``tool_calls`` it makes (none: the whole text is content)."""
    names = {t["function"]["name"] for t in spec.tools}
    decoder = json.JSONDecoder()
    calls: list[dict[str, Any]] = []
    if spec.style == "hermes":
        for m in _HERMES.finditer(text):
            try:
                call = _call(decoder.raw_decode(m.group(1))[0], names)
            except ValueError:
                call = None
            if call is not None:
                calls.append(call)
        content = text[: text.find("<tool_call>")].strip() if calls else text
        return content, calls
    body = text.strip()
    start = body.find("[TOOL_CALLS]")
    body = body[start + len("[TOOL_CALLS]") :].strip() if start >= 0 else body
    try:
        obj = decoder.raw_decode(body)[0]
    except ValueError:
        return text, []
    found = [_call(o, names) for o in (obj if isinstance(obj, list) else [obj])]
    if not found or any(c is None for c in found):
        return text, []
    return (text[:start].strip() if start > 0 else ""), [c for c in found if c is not None]


def call_deltas(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Streamed ``delta.tool_calls`` for ``calls``: per call, its id and name, then its arguments in pieces."""
    deltas: list[dict[str, Any]] = []
    for i, call in enumerate(calls):
        fn = call["function"]
        deltas.append(
            {"index": i, "id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": ""}}
        )
        args = fn["arguments"]
        for k in range(0, len(args), ARGUMENT_PIECE):
            deltas.append({"index": i, "function": {"arguments": args[k : k + ARGUMENT_PIECE]}})
    return deltas


# A call's head as the templates teach it, name first: its arguments then stream as they are written.
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"([^"\\]+)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')


class _ArgumentScan:
    """Where a JSON object that begins at ``start`` ends, found one character at a time as the text grows."""

    def __init__(self, start: int):
        self.pos = start
        self.depth = 0
        self.in_string = False
        self.escape = False

    def advance(self, text: str) -> int | None:
        """Scan what has arrived; the index just past the object once it is complete, else None."""
        while self.pos < len(text):
            c = text[self.pos]
            self.pos += 1
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return self.pos
        return None


class ToolStream:
    """Streamed text split as it comes: content is sent on while it cannot be a call; from where a call may begin the
    text is held. A held call whose head (``{"name": ..., "arguments": ``) names a tool is sent as ``delta.tool_calls``
    at once: its id and name, then its arguments piece by piece as the model writes them. At the end, held text that
    made no call is sent as content (and calls in another order, name after arguments, are parsed then)."""

    def __init__(self, spec: ToolSpec):
        self.spec = spec
        self.names = {t["function"]["name"] for t in spec.tools}
        self.text = ""
        self.sent = 0  # characters of text sent as content
        self.holding = spec.choice is not None  # a forced call: everything is the call
        self.cursor = 0  # where the next call's head is looked for
        self.scan: _ArgumentScan | None = None  # the arguments being streamed
        self.args_sent = 0  # their characters sent
        self.calls = 0  # calls streamed

    def feed(self, piece: str) -> tuple[str, list[dict[str, Any]]]:
        """The content and the tool-call deltas to send now for ``piece`` of text."""
        self.text += piece
        content = "" if self.holding else self._content()
        return content, (self._calls() if self.holding else [])

    def _content(self) -> str:
        if self.spec.style == "hermes":
            marker = "<tool_call>"
            at = self.text.find(marker, self.sent)
            if at >= 0:
                self.holding = True
                end = self.cursor = at
            else:  # keep back a tail that may be the marker's beginning
                keep = next((n for n in range(len(marker) - 1, 0, -1) if self.text.endswith(marker[:n])), 0)
                end = len(self.text) - keep
        else:
            head = self.text.lstrip()
            if not head:
                return ""
            if head[0] in "[{":
                self.holding = True
                self.cursor = self.sent
                return ""
            end = len(self.text)
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out

    def _calls(self) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        while True:
            if self.scan is None:
                m = _HEAD.search(self.text, self.cursor)
                if m is None or m.group(1) not in self.names:
                    return deltas
                call_id = "call_" + uuid.uuid4().hex[:24]
                fn = {"name": m.group(1), "arguments": ""}
                deltas.append({"index": self.calls, "id": call_id, "type": "function", "function": fn})
                self.scan, self.args_sent = _ArgumentScan(m.end()), m.end()
            end = self.scan.advance(self.text)
            upto = len(self.text) if end is None else end
            if upto > self.args_sent:
                args = self.text[self.args_sent : upto]
                deltas.append({"index": self.calls, "function": {"arguments": args}})
                self.args_sent = upto
            if end is None:
                return deltas
            self.scan, self.cursor, self.calls = None, end, self.calls + 1

    def finish(self) -> tuple[str, list[dict[str, Any]], bool]:
        """At the end: the content still to send, the last tool-call deltas, and whether the answer made calls."""
        if self.calls or self.scan is not None:  # calls were streamed
            return "", [], True
        _, calls = parse_calls(self.spec, self.text)
        if not calls:
            rest, self.sent = self.text[self.sent :], len(self.text)
            return rest, [], False
        return "", call_deltas(calls), True
