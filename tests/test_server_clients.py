"""Clients people already run, against the daemon's app served over HTTP in this process: the official ``ollama``
client on Ollama's API, the ``openai`` client with logprobs, ``echo`` and ``n``, and lm-evaluation-harness's
``local-completions`` loglikelihood requests, whose scores must equal the model's own computed directly."""

from __future__ import annotations

import json
import math
import socket
import threading
import time

import httpx
import ollama
import openai
import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")
MODEL = "tiny-moe"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def engine():
    from fate_edge import Engine
    from fate_edge.runtime.policy import get_policy

    # fp32 compute with the store's 16-bit experts, every one cached after its first read (64 MB holds them all)
    policy = get_policy("lru").with_(bits=16)
    with Engine.load(memory_budget="64MB", device="cpu", dtype="float32", policy=policy) as eng:
        yield eng


@pytest.fixture(scope="module")
def base(engine):
    import uvicorn

    from fate_edge.apps.engine_args import EngineOptions
    from fate_edge.apps.server import ServerSettings, create_app

    app = create_app(ServerSettings(engine=EngineOptions(memory_budget="64MB", device="cpu")), engine=engine)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


# --------------------------------------------------------------------------- ollama
def test_ollama_client_chat_generate_tags_show_ps(base):
    client = ollama.Client(host=base)
    assert client.list().models[0].model == f"{MODEL}:latest"
    shown = client.show(MODEL)
    assert shown.modelinfo["general.architecture"] == "qwen2_moe" and shown.template
    assert client.ps().models[0].model == f"{MODEL}:latest"
    opts = {"num_predict": 6, "temperature": 0, "seed": 3, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "num_ctx": 512}
    msgs = [{"role": "user", "content": "def add(a, b):"}]
    whole = client.chat(model=MODEL, messages=msgs, options=opts)
    assert whole.done and whole.done_reason in ("stop", "length") and whole.message.role == "assistant"
    assert 1 <= whole.eval_count <= 6 and whole.prompt_eval_count > 0 and whole.total_duration > 0
    parts = list(client.chat(model=MODEL, messages=msgs, options=opts, stream=True))
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert "".join(p.message.content for p in parts) == whole.message.content  # greedy: the same answer
    gen = client.generate(model=f"{MODEL}:latest", prompt="import os\n", raw=True, options=opts)
    assert gen.done and 1 <= gen.eval_count <= 6 and gen.prompt_eval_count > 0
    streamed = "".join(
        p.response for p in client.generate(model=MODEL, prompt="import os\n", raw=True, options=opts, stream=True)
    )
    assert streamed == gen.response
    assert client.generate(model=MODEL, prompt="x", options={"num_predict": 4, "repeat_penalty": 1.3}).eval_count <= 4


def test_ollama_errors_have_its_shape_and_the_daemon_keeps_serving(base):
    client = ollama.Client(host=base)
    with pytest.raises(ollama.ResponseError) as exc:
        client.chat(model=MODEL, messages=[{"role": "user", "content": "x"}], options={"temperature": "hot"})
    assert exc.value.status_code == 400 and "temperature" in exc.value.error
    with pytest.raises(ollama.ResponseError) as exc:
        client.generate(model=MODEL, prompt="x", options={"num_predict": 2.5})
    assert exc.value.status_code == 400 and "num_predict" in exc.value.error
    with pytest.raises(ollama.ResponseError) as exc:
        client.chat(model="llama3", messages=[{"role": "user", "content": "x"}])
    assert exc.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as exc:
        client.generate(model=MODEL, prompt="x", images=["aGk="])
    assert exc.value.status_code == 400 and "images" in exc.value.error
    with pytest.raises(ollama.ResponseError) as exc:
        client.generate(model=MODEL, prompt="x", format="json")
    assert exc.value.status_code == 400 and "format" in exc.value.error
    with pytest.raises(ollama.ResponseError) as exc:
        client.pull(MODEL)
    assert exc.value.status_code == 501
    with pytest.raises(ollama.ResponseError) as exc:
        client.embed(model=MODEL, input="x")
    assert exc.value.status_code == 400 and "embeddings" in exc.value.error
    raw = httpx.post(f"{base}/api/chat", content=b"{", headers={"Content-Type": "application/json"})
    assert raw.status_code == 400 and set(raw.json()) == {"error"}
    foreign = httpx.get(f"{base}/api/tags", headers={"Origin": "http://evil.example"})
    assert foreign.status_code == 403 and set(foreign.json()) == {"error"}
    assert httpx.get(f"{base}/api/nothing").json().keys() == {"error"}
    assert client.generate(model=MODEL, prompt="ok", options={"num_predict": 2}).done  # still serving
    assert httpx.get(f"{base}/api/version").json()["version"]
