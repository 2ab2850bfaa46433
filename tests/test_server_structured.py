"""Structured output and tool calls through the daemon, with the official ``openai`` client.

The bundled model is a tiny code model that knows nothing of JSON or tools: every valid answer here is the grammar
mask's work (runtime.structured, llguidance). Tool calls use a copy of the bundled model whose chat template is
Hermes/Qwen-style (it renders ``tools`` and teaches ``<tool_call>``), written in the test.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest
from test_server import MODEL, Server

from fate_edge.bundled import bundled_model_dir

pytestmark = pytest.mark.usefixtures("one_thread")

SCHEMAS = [
    {  # flat object: bounded string, integer range, array of enums
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    },
    {  # a top-level array of objects
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}},
            "required": ["id", "ok"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
    {  # nesting, an enum and a nullable union
        "type": "object",
        "properties": {
            "op": {"enum": ["add", "sub", "mul"]},
            "args": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": -50, "maximum": 50},
                    "b": {"type": "integer", "minimum": -50, "maximum": 50},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
            "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 8}]},
        },
        "required": ["op", "args", "note"],
        "additionalProperties": False,
    },
    {  # a string pattern
        "type": "object",
        "properties": {
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "count": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["date", "count"],
        "additionalProperties": False,
    },
]
PROMPTS = ["def main():", "import json\n", "class Tree:", "# parse the file\n", "for i in range("]

# Qwen2.5's tool-calling chat template, shortened (the same tools block, <tool_call> and <tool_response> syntax).
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant"
    "{% if message.content %}\n{{ message.content }}{% endif %}"
    "{%- for tool_call in message.tool_calls or [] %}"
    '\n<tool_call>\n{"name": "{{ tool_call.function.name }}", "arguments": '
    "{{ tool_call.function.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fe-structured")


@pytest.fixture(scope="module")
def server(default_server):
    return default_server  # shared with the other module that needs only a default daemon (tests/conftest.py)


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def tool_server(cache):
    """The bundled model with a Hermes/Qwen-style chat template that renders tools."""
    model = cache / "tiny-moe-tools"
    shutil.copytree(bundled_model_dir(), model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = HERMES_TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    s = Server(cache, "--model", str(model), "--model-alias", MODEL)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tool_client(tool_server):
    return tool_server.client()


# --------------------------------------------------------------------------- response_format
def _json_schema_answer(client: openai.OpenAI, i: int) -> tuple[dict, str, str]:
    schema = SCHEMAS[i % len(SCHEMAS)]
    fmt = {"type": "json_schema", "json_schema": {"name": f"shape{i % len(SCHEMAS)}", "schema": schema}}
    kw = dict(model=MODEL, max_tokens=96, temperature=0.6 + (i % 7) * 0.1, seed=1000 + i)
    prompt = PROMPTS[i % len(PROMPTS)]
    if i % 2:
        r = client.completions.create(prompt=prompt, extra_body={"response_format": fmt}, **kw)
        return schema, r.choices[0].text, r.choices[0].finish_reason
    c = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], response_format=fmt, **kw)
    return schema, c.choices[0].message.content or "", c.choices[0].finish_reason


@pytest.mark.slow
def test_a_hundred_sampled_json_schema_answers_all_validate(client):
    """Four schemas of different shapes, chat and completions, sampled (temperature 0.6-1.2, a seed each), four at a
    time (so through the batch too): every answer is complete JSON valid against its schema."""
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: _json_schema_answer(client, i), range(100)))
    for schema, text, finish in answers:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)
    assert len({text for _, text, _ in answers}) > 50  # sampled, not one answer repeated


def test_json_schema_streamed_and_greedy(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[2]}}
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], response_format=fmt, max_tokens=96, stream=True
    )
    parts, finish = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads("".join(parts)), SCHEMAS[2])
    greedy = client.completions.create(
        model=MODEL, prompt="def f():", max_tokens=96, temperature=0, extra_body={"response_format": fmt}
    )
    jsonschema.validate(json.loads(greedy.choices[0].text), SCHEMAS[2])


def test_json_object_answers_parse_as_objects(client):
    for seed, temperature in [(1, 0.0), (2, 0.7), (3, 1.0)]:
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Describe a tree as JSON"}],
            response_format={"type": "json_object"},
            max_tokens=200,
            temperature=temperature,
            seed=seed,
        )
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(r.choices[0].message.content or ""), dict)


def test_a_schema_the_library_refuses_is_a_400_naming_response_format(server, client):
    for schema in ({"type": "nope"}, {"type": "object", "properties": {"a": {"$ref": "#/missing"}}}):
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "x"}],
                response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": schema}},
                max_tokens=4,
            )
        assert exc.value.body["param"] == "response_format.json_schema.schema"
    r = server.http.post("/v1/completions", json={"prompt": "x", "response_format": {"type": "xml"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.type"
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text is not None


# --------------------------------------------------------------------------- tools
def _arguments(call, tool) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_tool_call_round_trip(tool_client):
    first = tool_client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=64,
        temperature=0.8,
        seed=7,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    _arguments(call, WEATHER)
    history = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    second = tool_client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, max_tokens=12, temperature=0, seed=1
    )
    assert second.choices[0].finish_reason in ("stop", "length")
    assert not second.choices[0].message.tool_calls
    assert second.choices[0].message.content


def test_tool_call_round_trip_streamed(tool_client):
    stream = tool_client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=64, stream=True, seed=3
    )
    calls: dict[int, dict] = {}
    pieces, finish = 0, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            call["arguments"] += d.function.arguments or ""
            pieces += 1
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1 and pieces > 2  # the name, then arguments in pieces
    call = calls[0]
    tool = {"get_weather": WEATHER, "get_time": CLOCK}[call["name"]]
    jsonschema.validate(json.loads(call["arguments"]), tool["function"]["parameters"])
    history = [
        *ASK,
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call["id"], "content": "21 degrees"},
    ]
    text = []
    for chunk in tool_client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, max_tokens=12, temperature=0, stream=True
    ):
        if chunk.choices:
            assert not chunk.choices[0].delta.tool_calls
            text.append(chunk.choices[0].delta.content or "")
    assert "".join(text)


def test_tool_choice_none_renders_no_tools_and_bad_tools_are_400s(tool_server, tool_client):
    r = tool_client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=4, temperature=0
    )
    usage_none = r.usage.prompt_tokens
    r = tool_client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0)
    assert usage_none == r.usage.prompt_tokens  # no tools block in the prompt
    bad = [
        ([WEATHER, WEATHER], "tools"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
            "tools[0].function.parameters",
        ),
        ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "tools[0].function.parameters"),
    ]
    for tools, param in bad:
        resp = tool_server.http.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": ASK, "tools": tools, "max_tokens": 4}
        )
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    resp = tool_server.http.post(
        "/v1/chat/completions",
        json={"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tool_choice"
    assert tool_client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2).choices[0].message.content
