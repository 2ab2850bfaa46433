"""Clients people already run, against the daemon's app served over HTTP in this process: the official ``ollama``
client on Ollama's API, the ``openai`` client with logprobs, ``echo`` and ``n``, and lm-evaluation-harness's
``local-completions`` loglikelihood requests, whose scores must equal the model's own computed directly."""

from __future__ import annotations

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
def engine(baseline_store):
    from fate_edge import Engine
    from fate_edge.runtime.policy import get_policy

    # fp32 compute with the baseline store's 16-bit experts and float resident weights, every expert cached after its
    # first read (64 MB holds them all)
    policy = get_policy("lru").with_(bits=16)
    with Engine.load(baseline_store, memory_budget="64MB", device="cpu", dtype="float32", policy=policy) as eng:
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


def test_ollama_format_json_and_a_schema_constrain_the_answer(base):
    import json

    import jsonschema

    client = ollama.Client(host=base)
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "size": {"type": "integer", "maximum": 999}},
        "required": ["name", "size"],
        "additionalProperties": False,
    }
    for seed in range(3):
        opts = {"num_predict": 96, "temperature": 1.0, "seed": seed}
        answer = client.chat(model=MODEL, messages=[{"role": "user", "content": "x"}], format=schema, options=opts)
        assert answer.done_reason == "stop"
        jsonschema.validate(json.loads(answer.message.content), schema)
    for seed, temperature in [(1, 0.0), (2, 0.7), (3, 1.0)]:  # any object: the grammar alone ends it
        free = client.chat(
            model=MODEL,
            messages=[{"role": "user", "content": "Describe a tree as JSON"}],
            format="json",
            options={"num_predict": 200, "temperature": temperature, "seed": seed},
        )
        assert free.done_reason == "stop" and isinstance(json.loads(free.message.content), dict)


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
        client.generate(model=MODEL, prompt="x", format={"type": "object", "properties": 3})
    assert exc.value.status_code == 400 and "format" in exc.value.error
    with pytest.raises(ollama.ResponseError) as exc:
        client.pull(MODEL)
    assert exc.value.status_code == 501
    with pytest.raises(ollama.ResponseError) as exc:
        client.embed(model=MODEL, input="x")
    assert exc.value.status_code == 400 and "embeddings" in exc.value.error
    with pytest.raises(ollama.ResponseError) as exc:  # a prompt longer than the request's num_ctx
        client.generate(model=MODEL, prompt="word " * 200, raw=True, options={"num_ctx": 64})
    assert exc.value.status_code == 400 and "64" in exc.value.error
    raw = httpx.post(f"{base}/api/chat", content=b"{", headers={"Content-Type": "application/json"})
    assert raw.status_code == 400 and set(raw.json()) == {"error"}
    foreign = httpx.get(f"{base}/api/tags", headers={"Origin": "http://evil.example"})
    assert foreign.status_code == 403 and set(foreign.json()) == {"error"}
    assert httpx.get(f"{base}/api/nothing").json().keys() == {"error"}
    assert client.generate(model=MODEL, prompt="ok", options={"num_predict": 2}).done  # still serving
    assert httpx.get(f"{base}/api/version").json()["version"]
    assert httpx.head(base).status_code == 200  # Ollama's heartbeat


# --------------------------------------------------------------------------- prompt cache
def _series(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics").text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_a_chats_next_turn_hits_the_prompt_cache_and_cache_prompt_false_opts_out(base):
    client = ollama.Client(host=base)
    opts = {"num_predict": 4, "temperature": 0}
    msgs = [{"role": "user", "content": "Write a function that adds two numbers, please. " * 4}]
    first = client.chat(model=MODEL, messages=msgs, options=opts)
    hits, saved = (
        _series(base, "fate_edge_prompt_cache_hits_total"),
        _series(base, "fate_edge_prompt_cache_tokens_saved_total"),
    )
    msgs += [{"role": "assistant", "content": first.message.content}, {"role": "user", "content": "And subtract?"}]
    second = client.chat(model=MODEL, messages=msgs, options=opts)
    assert _series(base, "fate_edge_prompt_cache_hits_total") == hits + 1
    assert _series(base, "fate_edge_prompt_cache_tokens_saved_total") - saved >= first.prompt_eval_count
    assert 0 < _series(base, "fate_edge_prompt_cache_bytes") <= _series(base, "fate_edge_prompt_cache_capacity_bytes")
    hits = _series(base, "fate_edge_prompt_cache_hits_total")
    off = client.chat(model=MODEL, messages=msgs, options={**opts, "cache_prompt": False})
    assert off.message.content == second.message.content  # greedy: the same answer without the cache
    http = httpx.Client(base_url=base, timeout=60)
    body = {"model": MODEL, "messages": msgs, "max_tokens": 4, "temperature": 0, "cache_prompt": False}
    chat = http.post("/v1/chat/completions", json=body)
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] == second.message.content
    assert _series(base, "fate_edge_prompt_cache_hits_total") == hits  # neither looked
    bad = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "cache_prompt": "no"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_prompt"


def test_openai_usage_reports_the_prompt_tokens_the_cache_held(base):
    """usage.prompt_tokens_details.cached_tokens (OpenAI's field): the prompt positions a request took from the
    prompt cache, the same count the cache's metrics add, in the whole answer and the streamed usage chunk; 0 where
    the request opts out."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
    kw = dict(model=MODEL, max_tokens=4, temperature=0)
    msgs = [{"role": "user", "content": "Sort a list of words by their length, shortest first. " * 3}]
    first = client.chat.completions.create(messages=msgs, **kw)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "Why?"}]
    saved = _series(base, "fate_edge_prompt_cache_tokens_saved_total")
    second = client.chat.completions.create(messages=msgs, **kw)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == _series(base, "fate_edge_prompt_cache_tokens_saved_total") - saved
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
    chunks = list(
        client.chat.completions.create(messages=msgs, stream=True, stream_options={"include_usage": True}, **kw)
    )
    usage = chunks[-1].usage
    assert usage.prompt_tokens == second.usage.prompt_tokens and usage.prompt_tokens_details.cached_tokens >= cached
    off = client.chat.completions.create(messages=msgs, extra_body={"cache_prompt": False}, **kw)
    assert off.usage.prompt_tokens_details.cached_tokens == 0
    done = client.completions.create(prompt=msgs[0]["content"], extra_body={"cache_prompt": False}, **kw)
    assert done.usage.prompt_tokens_details.cached_tokens == 0


# --------------------------------------------------------------------------- openai: logprobs, echo, n
def _direct(engine, ids: list[int]) -> list[float]:
    """Each token's log-probability given those before it, from one forward of the engine's model (the first: nan)."""
    with engine._lock, torch.inference_mode():
        logits = engine.model(torch.tensor([ids]), engine.model.new_cache())[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [math.nan] + [float(lp[i, t]) for i, t in enumerate(ids[1:])]


def test_openai_logprobs_on_chat_and_completions_streamed_and_not(base, engine):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
    kw = dict(model=MODEL, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    comp = client.completions.create(prompt="def add(a, b):", logprobs=3, **kw)
    lp = comp.choices[0].logprobs
    ids = engine.tokenizer.encode("def add(a, b):")
    gen = [engine.tokenizer.encode(t, add_special_tokens=False) for t in lp.tokens]
    assert all(len(g) == 1 for g in gen)
    direct = _direct(engine, ids + [g[0] for g in gen])[len(ids) :]
    assert lp.token_logprobs == pytest.approx(direct, abs=1e-4)
    for tok, top, chosen in zip(lp.tokens, lp.top_logprobs, lp.token_logprobs):
        assert len(top) == 3 and max(top.values()) == pytest.approx(chosen)  # greedy: the chosen is the likeliest
        assert top[tok] == chosen
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == comp.choices[0].text
    streamed = list(client.completions.create(prompt="def add(a, b):", logprobs=3, stream=True, **kw))
    lps = [c.choices[0].logprobs for c in streamed if c.choices[0].logprobs]  # the finishing chunk has none
    assert [t for p in lps for t in p.token_logprobs] == pytest.approx(lp.token_logprobs)
    assert [o for p in lps for o in p.text_offset] == lp.text_offset

    msgs = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(messages=msgs, logprobs=True, top_logprobs=2, **kw)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and "".join(c.token for c in content) == chat.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob)
        assert bytes(c.bytes).decode() == c.token and c.logprob <= 0
    parts = [c for c in client.chat.completions.create(messages=msgs, logprobs=True, top_logprobs=2, stream=True, **kw)]
    got = [e.logprob for p in parts if p.choices and p.choices[0].logprobs for e in p.choices[0].logprobs.content]
    assert got == pytest.approx([c.logprob for c in content])
    plain = client.chat.completions.create(messages=msgs, **kw)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == chat.choices[0].message.content


def test_echo_with_max_tokens_0_scores_the_prompt(base, engine):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
    prompt = "import os\nimport sys\n" * 30  # over one scoring chunk (128 positions)
    ids = engine.tokenizer.encode(prompt)
    assert len(ids) > 128
    r = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=0, temperature=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == prompt and r.usage.completion_tokens == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
    assert lp.token_logprobs[1:] == pytest.approx(_direct(engine, ids)[1:], abs=1e-4)
    slab = engine.batcher._slab  # the scoring pass took its KV cache from the batch's slab, and gave it back
    assert slab is not None and slab.free_positions == slab.positions
    # echo with a token prompt and one generated token (what lm-eval sends): the prompt's entries, then the new one's
    r = client.completions.create(model=MODEL, prompt=ids[:10], echo=True, logprobs=2, max_tokens=1, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 11 and lp.token_logprobs[1:10] == pytest.approx(
        _direct(engine, ids[:10])[1:], abs=1e-4
    )


def test_n_choices_are_decoded_together_each_its_own(base, engine):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
    kw = dict(model=MODEL, max_tokens=6, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    r = client.completions.create(prompt="def f(x):", n=3, **kw)
    assert sorted(c.index for c in r.choices) == [0, 1, 2] and r.usage.completion_tokens == 18
    again = client.completions.create(prompt="def f(x):", n=3, **kw)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # a seed repeats every choice
    assert len({c.text for c in r.choices}) > 1  # ... and the choices differ (seed + index)
    stats = engine.batcher.stats
    steps, stepped = stats.steps, stats.sequences_stepped
    long = client.completions.create(prompt="def f(x):", n=4, **{**kw, "max_tokens": 24})
    assert len(long.choices) == 4
    assert stats.sequences_stepped - stepped > 1.5 * (stats.steps - steps)  # the choices shared steps
    first = client.completions.create(prompt="def f(x):", n=1, **kw)
    assert first.choices[0].text == r.choices[0].text
    texts = ["", "", ""]
    for chunk in client.chat.completions.create(messages=[{"role": "user", "content": "x"}], n=3, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "x"}], n=3, **kw)
    assert texts == [c.message.content for c in sorted(chat.choices, key=lambda c: c.index)]


def test_bad_logprobs_and_n_get_openai_errors_naming_the_field(base):
    http = httpx.Client(base_url=base, timeout=60)
    cases = [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "x", "n": 16, "max_tokens": 1000}, "n"),  # 16 x 1000 positions: over the KV room
    ]
    cases.append(("/v1/completions", {"prompt": ["a"] * 30, "max_tokens": 1}, "prompt"))  # over batch + queue places
    cases.append(("/v1/completions", {"prompt": ["a"] * 4, "max_tokens": 1000, "n": 4}, "prompt"))  # over the KV room
    for path, body, param in cases:
        r = http.post(path, json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


# --------------------------------------------------------------------------- lm-evaluation-harness
# lm_eval itself runs against the daemon in tests/test_lm_eval.py. Its local-completions loglikelihood requests are
# also written out here (lm_eval 0.4.13: TemplateLM._encode_pair, TemplateAPI.batch_loglikelihood_requests,
# LocalCompletionsAPI._create_payload and parse_logprobs) for what that test does not check: the scores against
# transformers' own model (an implementation not ours), a --batch_size request of several prompts, and max_tokens 0.
TASK = [  # a small multiple-choice task: (context, choices, gold)
    ("def add(a, b):\n    return", [" a + b", " a - b", " print(a)"], 0),
    ("import os\nimport", [" sys", " 42", " ("], 0),
    ("for i in range(10):\n   ", [" print(i)", " return", " class"], 0),
    ("# the sum of a list\ntotal =", [" sum(values)", " None", " 1 / 0"], 0),
]


def _encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx) :]


def _parse_logprobs(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=lambda c: c["index"]), ctxlens):
        assert ctxlen > 0
        logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
        is_greedy = all(
            tok == max(top.values())
            for tok, top in zip(
                choice["logprobs"]["token_logprobs"][ctxlen:-1], choice["logprobs"]["top_logprobs"][ctxlen:-1]
            )
        )
        res.append((logprobs, is_greedy))
    return res


@pytest.fixture(scope="module")
def hf_same_experts(tmp_path_factory):
    """The bundled checkpoint in transformers at fp32, its routed experts rounded to the store's bf16 (the weights the
    engine serves), so the daemon's scores can be checked against an implementation that is not ours."""
    import shutil

    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    from fate_edge.bundled import bundled_model_dir

    src = bundled_model_dir()
    dst = tmp_path_factory.mktemp("hf-bf16-experts")
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    w = load_file(str(src / "model.safetensors"))
    save_file(
        {k: v.bfloat16().float() if ".mlp.experts." in k else v for k, v in w.items()}, str(dst / "model.safetensors")
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(dst)


@pytest.mark.slow  # transformers loads the reference model
def test_lm_eval_loglikelihood_through_the_daemon_equals_the_model_directly(base, engine, hf_same_experts):
    hf, tok = hf_same_experts
    http = httpx.Client(base_url=base, timeout=120)
    for context, choices, _gold in TASK:
        scores, direct, reference, batch = [], [], [], []
        for cont in choices:
            ctx, cont_enc = _encode_pair(tok, context, cont)
            inp, ctxlen = (ctx + cont_enc)[-2048:], len(ctx)
            payload = {
                "model": MODEL,
                "prompt": [inp],
                "temperature": 0,
                "max_tokens": 1,
                "logprobs": 1,
                "seed": 1234,
                "echo": True,
            }
            r = http.post("/v1/completions", json=payload)
            assert r.status_code == 200, r.text
            ((score, _greedy),) = _parse_logprobs(r.json(), [ctxlen])
            scores.append(score)
            batch.append((inp, ctxlen))
            direct.append(sum(_direct(engine, inp)[ctxlen:]))
            with torch.inference_mode():
                lp = torch.log_softmax(hf(torch.tensor([inp])).logits[0].float(), dim=-1)
            reference.append(sum(float(lp[i - 1, inp[i]]) for i in range(ctxlen, len(inp))))
            # max_tokens 0 (what the loglikelihood request sends) scores the same prompt the same way
            r0 = http.post("/v1/completions", json={**payload, "max_tokens": 0}).json()
            assert r0["choices"][0]["logprobs"]["token_logprobs"][ctxlen:] == pytest.approx(
                r.json()["choices"][0]["logprobs"]["token_logprobs"][ctxlen:-1]
            )
        # lm-eval's --batch_size: the question's requests as one batch of prompts, choices in the prompts' order
        payload["prompt"] = [inp for inp, _ in batch]
        r = http.post("/v1/completions", json=payload)
        assert r.status_code == 200, r.text
        batched = _parse_logprobs(r.json(), [c for _, c in batch])
        assert [s for s, _ in batched] == pytest.approx(scores, abs=1e-5)
        assert r.json()["usage"]["prompt_tokens"] == sum(len(i) for i, _ in batch)
        assert scores == pytest.approx(direct, abs=1e-4)
        assert scores == pytest.approx(reference, abs=1e-4)
        assert max(range(len(choices)), key=scores.__getitem__) == max(range(len(choices)), key=reference.__getitem__)


def test_lm_eval_generate_until_requests_run(base, engine):
    """lm-eval's generate_until payload (LocalCompletionsAPI._create_payload with generate=True) and its parsing."""
    http = httpx.Client(base_url=base, timeout=120)
    contexts = ["def add(a, b):\n", "import os\n"]
    prompts = [engine.tokenizer.encode(c) for c in contexts]  # tokenized_requests: token ids, a batch of two
    payload = {"prompt": prompts, "model": MODEL, "max_tokens": 12, "temperature": 0, "stop": ["\n\n"], "seed": 1234}
    out = http.post("/v1/completions", json=payload).json()
    tmp = [None] * len(out["choices"])
    for choice in out["choices"]:  # parse_generations
        tmp[choice["index"]] = choice["text"]
    alone = [
        http.post("/v1/completions", json={**payload, "prompt": [p]}).json()["choices"][0]["text"] for p in prompts
    ]
    assert tmp == alone and all(isinstance(t, str) and "\n\n" not in t for t in tmp)
