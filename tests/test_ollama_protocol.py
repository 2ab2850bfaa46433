"""Ollama request options → the engine's GenerateConfig: Ollama's defaults and special values; a wrong type named."""

from __future__ import annotations

import pytest

from fate_edge.apps.server.errors import OllamaError
from fate_edge.apps.server.ollama_protocol import common, config_of, generate_prompt


def test_defaults_are_ollamas_and_special_values_map():
    c = config_of({}, 1024)
    s = c.sampling
    assert (s.temperature, s.top_k, s.top_p, s.min_p, s.repetition_penalty, s.seed) == (0.8, 40, 0.9, 0.0, 1.0, None)
    assert c.max_tokens is None and c.context_limit == 1024 and c.stop == []
    opts = {"num_predict": -2, "seed": -1, "top_p": 0, "num_ctx": 4096, "stop": "\n", "repeat_penalty": 1.2}
    c = config_of({"options": opts}, 1024)
    assert c.max_tokens is None and c.sampling.seed is None and c.sampling.top_p == 1.0
    assert c.context_limit == 1024 and c.stop == ["\n"] and c.sampling.repetition_penalty == 1.2
    c = config_of({"options": {"num_predict": 5000, "temperature": 0, "seed": 7, "min_p": 0.1, "num_ctx": 100}}, 1024)
    assert c.max_tokens == 1024 and c.sampling.temperature == 0 and c.sampling.seed == 7 and c.context_limit == 100
    assert config_of({"options": {"num_predict": 3.0, "unknown_knob": "x", "num_gpu": 99}}, 1024).max_tokens == 3


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"top_k": 1.5}, "top_k"),
        ({"num_predict": "10"}, "num_predict"),
        ({"seed": True}, "seed"),
        ({"top_p": 2}, "top_p"),
        ({"stop": [1]}, "stop"),
        ({"repeat_penalty": None, "min_p": [0.1]}, "min_p"),
        ({"cache_prompt": "no"}, "cache_prompt"),
    ],
)
def test_a_wrong_option_is_a_400_naming_it(options, field):
    with pytest.raises(OllamaError) as exc:
        config_of({"options": options}, 1024)
    assert exc.value.status == 400 and f'"{field}"' in exc.value.message


def test_request_level_fields():
    assert common({"model": "m"}) == ("m", True)
    assert common({"model": "m", "stream": False, "keep_alive": "5m"}) == ("m", False)
    for body, word in [
        ({}, "model"),
        ({"model": "m", "stream": "no"}, "stream"),
        ({"model": "m", "format": "yaml"}, "format"),
        ({"model": "m", "options": 3}, "options"),
    ]:
        with pytest.raises(OllamaError, match=word):
            common(body)
            config_of(body, 1024)
    assert generate_prompt({"prompt": "x", "raw": True}, None) == "x"
    assert generate_prompt({"prompt": "x", "system": "s"}, lambda m: repr(m)) == repr(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "x"}]
    )
    with pytest.raises(OllamaError, match="images") as exc:
        generate_prompt({"prompt": "x", "images": ["aGk="]}, None)
    assert exc.value.status == 400


def test_cache_prompt_opts_out_in_options_or_the_body():
    assert config_of({}, 1024).cache_prompt
    assert not config_of({"options": {"cache_prompt": False}}, 1024).cache_prompt
    assert not config_of({"cache_prompt": False}, 1024).cache_prompt
    with pytest.raises(OllamaError, match="cache_prompt"):
        config_of({"cache_prompt": 0}, 1024)
