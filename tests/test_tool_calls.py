"""Tool-call syntaxes (Hermes/Qwen, Mistral, Llama 3.x JSON): told from the template, forced by grammar on the bundled
model, parsed back, and streamed as deltas."""

from __future__ import annotations

import json

import jsonschema
import pytest

from fate_edge.apps.server.errors import APIError
from fate_edge.apps.server.tool_calls import ToolStream, forced_call_grammar, parse_calls, parse_tools, tool_style
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.generate import GenerateConfig
from fate_edge.runtime.sampling import SamplingParams

PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "forecast", "parameters": PARAMS}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},
]
# The lines of each family's template that matter here.
TEMPLATES = {
    "hermes": "{% if tools %}<tools>{{ tools | tojson }}</tools> reply with <tool_call>{...}</tool_call>{% endif %}",
    "mistral": "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]",
    "llama": '{% if tools %}Respond with {"name": function name, "parameters": dictionary}{{ tools }}{% endif %}',
}


def test_the_style_is_read_from_the_template():
    for style, template in TEMPLATES.items():
        assert tool_style(template) == style
    assert tool_style("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert tool_style(None) is None


@pytest.fixture(scope="module")
def engine():
    with Engine.load(memory_budget="2MB", device="cpu", max_batch=1) as eng:
        yield eng


@pytest.mark.parametrize("style", sorted(TEMPLATES))
def test_a_forced_call_in_each_syntax_parses_back_and_validates(engine, style):
    """The bundled model knows no tools: the grammar writes the call, the parser reads it back, sampled or greedy."""
    for seed, temperature in [(0, 0.0), (1, 0.9), (2, 1.2)]:
        body = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "forecast"}}}
        spec = parse_tools(body, TEMPLATES[style])
        assert spec is not None and spec.style == style and spec.grammar is not None
        cfg = GenerateConfig(
            max_tokens=64, sampling=SamplingParams(temperature=temperature, seed=seed), grammar=spec.grammar
        )
        text, last = engine.generate_text("def main():", cfg)
        assert last.finish_reason == "stop", text
        content, calls = parse_calls(spec, text)
        assert len(calls) == 1 and calls[0]["function"]["name"] == "forecast", text
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), PARAMS)
        # streamed a few characters at a time: the same call, the arguments in several pieces
        stream = ToolStream(spec)
        deltas = [d for i in range(0, len(text), 3) for d in stream.feed(text[i : i + 3])[1]]
        assert stream.finish()[2]
        assert deltas[0]["function"]["name"] == "forecast" and len(deltas) > 2
        args = "".join(d["function"]["arguments"] for d in deltas)
        assert json.loads(args) == json.loads(calls[0]["function"]["arguments"])


def test_required_picks_one_of_the_tools(engine):
    spec = parse_tools({"tools": TOOLS, "tool_choice": "required"}, TEMPLATES["hermes"])
    assert spec is not None
    names = set()
    for seed in range(4):
        cfg = GenerateConfig(max_tokens=64, sampling=SamplingParams(temperature=1.0, seed=seed), grammar=spec.grammar)
        _, calls = parse_calls(spec, engine.generate_text("x", cfg)[0])
        assert len(calls) == 1
        names.add(calls[0]["function"]["name"])
    assert names <= {"forecast", "noop"}


def test_auto_answers_keep_plain_text_and_find_calls_among_it():
    spec = parse_tools({"tools": TOOLS}, TEMPLATES["hermes"])
    assert spec is not None and spec.grammar is None
    assert parse_calls(spec, "just text <tool") == ("just text <tool", [])
    text = 'Let me look. <tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
    content, calls = parse_calls(spec, text)
    assert content == "Let me look." and calls[0]["function"] == {"name": "noop", "arguments": "{}"}
    stream = ToolStream(spec)
    sent = "".join(stream.feed(text[i : i + 4])[0] for i in range(0, len(text), 4))
    assert sent.strip() == "Let me look."
    plain = ToolStream(spec)
    assert "".join(plain.feed(p)[0] for p in ["a <", "b"]) + plain.finish()[0] == "a <b"
    unknown = 'x <tool_call>{"name": "rm", "arguments": {}}</tool_call>'
    assert parse_calls(spec, unknown) == (unknown, [])  # a function it was not given is no call
    mistral = parse_tools({"tools": TOOLS}, TEMPLATES["mistral"])
    assert mistral is not None
    _, calls = parse_calls(
        mistral, '[TOOL_CALLS][{"name": "noop", "arguments": {}}, {"name": "noop", "arguments": {}}]'
    )
    assert len(calls) == 2


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_bad_tools_are_400s_naming_the_field(body, param):
    with pytest.raises(APIError) as exc:
        parse_tools(body, TEMPLATES["hermes"])
    assert exc.value.status == 400 and exc.value.param == param


def test_a_template_without_tools_refuses_them_and_none_renders_none():
    with pytest.raises(APIError) as exc:
        parse_tools({"tools": TOOLS}, "{{ messages }}")
    assert exc.value.param == "tools"
    assert parse_tools({"tools": TOOLS, "tool_choice": "none"}, "{{ messages }}") is None


def test_forced_grammars_compile_for_every_style():
    for style in TEMPLATES:
        assert forced_call_grammar(style, [TOOLS[0]["function"], TOOLS[1]["function"]])
