"""``max_tokens`` absent means until end of text or the context (as llama-server and Ollama), in the SDK, the CLI
and the daemon; the daemon's own default is a serve option. Before, the SDK and the daemon stopped at 256 tokens
and ``run`` at 128 (and the SDK's 256 did not fit a smaller engine's KV room: a BudgetError)."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from fate_edge import Engine
from fate_edge.apps.cli import main
from fate_edge.apps.server import ServerSettings, create_app
from fate_edge.sdk import generate

CONTEXT = 48
PROMPT = "def f():"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engine():
    with Engine.load(memory_budget="8MB", context_tokens=CONTEXT, threads=1) as e:
        yield e


def test_sdk_generates_until_the_engines_context(engine):
    done = generate(engine, PROMPT, ignore_eos=True)
    assert done.finish_reason == "length"
    assert done.prompt_tokens + done.completion_tokens == CONTEXT
    assert generate(engine, PROMPT, max_tokens=3, ignore_eos=True).completion_tokens == 3


def test_run_without_max_tokens_fills_the_context(capsys):
    assert main(["run", "--context-tokens", "40", "--ignore-eos", PROMPT]) == 0
    m = re.search(r"\[(\d+) prompt tokens .*?(\d+) generated .*finish: length", capsys.readouterr().err)
    assert m is not None and int(m.group(1)) + int(m.group(2)) == 40


def _completion(settings: ServerSettings, engine, body: dict) -> dict:
    with TestClient(create_app(settings, engine=engine), base_url="http://localhost") as tc:
        r = tc.post("/v1/completions", json={"prompt": PROMPT, "temperature": 0, "ignore_eos": True, **body})
        assert r.status_code == 200, r.text
        return r.json()


def test_daemon_without_max_tokens_fills_the_context_and_its_default_is_an_option(engine):
    usage = _completion(ServerSettings(), engine, {})["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == CONTEXT
    assert _completion(ServerSettings(default_max_tokens=5), engine, {})["usage"]["completion_tokens"] == 5
    assert _completion(ServerSettings(), engine, {"max_tokens": 2})["usage"]["completion_tokens"] == 2
    from fate_edge.apps.cli_args import tokens_or_context

    assert tokens_or_context("context") is None and tokens_or_context("12") == 12
