"""The Python SDK: Engine exported from the package, typed results, keyword helpers, thread safety, recovery."""

import errno
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import fate_edge
from fate_edge import Completion, Engine, GenerateConfig, GenerationError
from fate_edge.fetch.fetch_engine import FetchError, Priority
from fate_edge.sdk import chat, generate, generate_config, recover, stream

ROOT = Path(__file__).resolve().parents[1]
REQUESTS = [("def parse(line):", 1), ("import os\n", 2), ("class Point:", 3), ("def parse(line):", 4)]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("fe-cache")
    old = os.environ.get("FATE_EDGE_CACHE")
    os.environ["FATE_EDGE_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("FATE_EDGE_CACHE", None)
    else:
        os.environ["FATE_EDGE_CACHE"] = old


@pytest.fixture(scope="module")
def engine(cache_dir):
    with Engine.load(memory_budget="2MB", device="cpu") as e:
        yield e


def _kw(seed):
    return dict(max_tokens=10, temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True)


def test_engine_is_exported_and_typed(engine, cache_dir):
    assert fate_edge.Engine is Engine and "Engine" in fate_edge.__all__
    assert any(cache_dir.rglob("index.json")) or any(cache_dir.iterdir())  # converted into FATE_EDGE_CACHE
    done = engine.complete("def main():", GenerateConfig(max_tokens=6, ignore_eos=True))
    assert isinstance(done, Completion)
    assert isinstance(done.text, str) and done.finish_reason == "length"
    assert done.completion_tokens == 6 and done.prompt_tokens > 0
    assert done.generation_tps > 0 and done.peak_rss_bytes > 0 and done.stats.uses > 0
    assert engine.stats.uses >= done.stats.uses


def test_context_manager_closes_the_fetch_engine(cache_dir):
    with Engine.load(memory_budget="2MB", device="cpu") as e:
        assert generate(e, "x = ", max_tokens=2).completion_tokens == 2
    with pytest.raises(FetchError, match="closed"):
        e.fetch.submit(e.store.ref(e.model.config.moe_layers[0], 0, 4))


def test_keyword_helpers_match_generate_config(engine):
    kw = _kw(7)
    a = generate(engine, "def add(a, b):", **kw)
    b = engine.complete("def add(a, b):", generate_config(**kw))
    assert a.text == b.text and a.completion_tokens == b.completion_tokens == 10
    streamed = "".join(s.text for s in stream(engine, "def add(a, b):", **kw))
    assert streamed == a.text
    reply = chat(engine, [{"role": "user", "content": "hi"}], max_tokens=4)
    assert reply.prompt_tokens > 3 and reply.completion_tokens <= 4
    assert generate_config(stop="\n").stop == ["\n"]


@pytest.mark.parametrize(
    "kw",
    [
        dict(max_tokens=-1),
        dict(temperature=-0.5),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(min_p=1.0),
        dict(top_k=-2),
        dict(repetition_penalty=0),
        dict(stop=[""]),
        dict(stop=[3]),
        dict(max_tokens=2.5),
    ],
)
def test_bad_parameters_are_generation_errors(kw):
    with pytest.raises(GenerationError):
        generate_config(**kw)


def test_prompt_longer_than_the_context_is_a_clear_error(engine):
    ids = [5] * engine.model.config.max_position_embeddings
    with pytest.raises(GenerationError, match="context"):
        generate(engine, ids, max_tokens=2)
    assert generate(engine, "ok", max_tokens=2).completion_tokens == 2  # still serving


@pytest.mark.slow
def test_concurrent_threads_each_get_their_own_answer(engine):
    alone = {(p, s): generate(engine, p, **_kw(s)) for p, s in REQUESTS}
    results: dict[tuple[int, int], Completion] = {}
    errors = []

    def worker(t):
        try:
            for i, (p, s) in enumerate(REQUESTS):
                if (i + t) % 2 == 0:  # two entry points, interleaved across threads
                    results[(t, i)] = generate(engine, p, **_kw(s))
                else:
                    results[(t, i)] = engine.complete(p, generate_config(**_kw(s)))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(results) == 4 * len(REQUESTS)
    per_token = len(engine.model.config.moe_layers) * engine.model.config.num_experts_per_tok
    for (t, i), done in results.items():
        ref = alone[REQUESTS[i]]
        assert done.text == ref.text, (t, i)
        assert done.completion_tokens == ref.completion_tokens
        if (i + t) % 2 == 0:  # sdk.generate captures this request's stats while it is served
            prefill_max = len(engine.model.config.moe_layers) * engine.model.config.num_experts
            # Batched (Engine.load's default), a request's figures are its share of the steps it shared: the
            # experts a step reads once serve every sequence in it, so a share is below one request's alone.
            assert engine.max_batch > 1 and 0 < done.stats.uses
            assert done.stats.uses <= per_token * done.completion_tokens + prefill_max


def test_closing_a_stream_frees_the_engine(engine):
    steps = stream(engine, "def loop():", max_tokens=200, ignore_eos=True)
    for i, _ in enumerate(steps):
        if i == 2:
            break
    steps.close()
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("done", generate(engine, "x", max_tokens=3)))
    t.start()
    t.join(timeout=30)
    assert "done" in out and out["done"].completion_tokens == 3


def test_a_failed_read_fails_one_request_and_the_engine_recovers(engine):
    prompt, kw = "import sys\nimport json\n\ndef main(argv):\n    ", _kw(11)
    ref = generate(engine, prompt, **kw).text
    armed = {"left": 1}
    fetch = engine.fetch

    def injector(blob):
        req = fetch._pending.get(blob.key)
        if armed["left"] and req is not None and req.priority == Priority.DEMAND:
            armed["left"] -= 1
            raise OSError(errno.EIO, "injected")

    # A prompt the cache cannot hold whole: prefill needs demand reads.
    long_prompt = "".join(f"value_{i} = compute({i}, '{chr(97 + i % 26)}')\n" for i in range(40))
    fetch.fault_injector = injector
    try:
        with pytest.raises(FetchError, match="injected"):
            generate(engine, long_prompt, **kw)
    finally:
        fetch.fault_injector = None
    assert armed["left"] == 0
    recover(engine)
    assert fetch.pool.available == fetch.pool.count  # no read buffer lost to the failed request
    assert generate(engine, prompt, **kw).text == ref


@pytest.mark.slow
def test_minimal_example_runs(cache_dir):
    env = dict(os.environ, FATE_EDGE_CACHE=str(cache_dir), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "minimal.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert "tok/s" in proc.stdout and "expert hit rate" in proc.stdout
    assert len((ROOT / "examples" / "minimal.py").read_text().splitlines()) <= 20


def test_generate_and_chat_go_through_engine_complete_and_chat(monkeypatch):
    from fate_edge import Engine, sdk

    calls = []
    real_complete = Engine.complete
    monkeypatch.setattr(
        Engine, "complete", lambda self, p, c=None: (calls.append("complete"), real_complete(self, p, c))[1]
    )
    with Engine.load(memory_budget="4MB", policy="lru", device="cpu") as engine:
        done = sdk.generate(engine, "def ", max_tokens=3, ignore_eos=True)
        reply = sdk.chat(engine, [{"role": "user", "content": "hi"}], max_tokens=2, ignore_eos=True)
    assert done.completion_tokens == 3 and reply.completion_tokens == 2
    assert calls == ["complete", "complete"]  # Engine.chat completes through Engine.complete


def test_load_sets_torch_threads_as_the_cli_does(cache_dir):
    # torch's own default takes every core; beside the fetch worker that was a thread more than a 2-core host has
    import torch

    from fate_edge import defaults

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        with Engine.load(memory_budget="2MB", device="cpu", threads=None):
            assert torch.get_num_threads() == 3  # None: the process's own setting stands
        with Engine.load(memory_budget="2MB", device="cpu"):  # "auto", experts streaming: the fetch worker's core kept
            assert defaults.THREADS == "auto" and torch.get_num_threads() == defaults.STREAMING_THREADS
            assert defaults.STREAMING_THREADS + defaults.FETCH_WORKERS <= max(2, os.cpu_count() or 2)
        with Engine.load(memory_budget="2MB", device="cpu", threads=2):
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
