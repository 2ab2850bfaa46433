"""lm-evaluation-harness itself (``lm_eval``, not a reproduction) against the daemon: its ``local-completions`` model
scores a multiple-choice task by loglikelihood and runs a generate-until task, its ``local-chat-completions`` model a
generate-until task through the chat template. The tasks are written in the test from local data (a task YAML and a
jsonl file in tmp_path; nothing is downloaded). The loglikelihood of every choice equals the one computed directly on
the same checkpoint (fp32: within 1e-4); with int4 experts the daemon's ranking is the fp32 reference's."""

from __future__ import annotations

import contextlib
import json
import math
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
from lm_eval import simple_evaluate  # in the test extra (lm-eval[api]): pip install -e .[test]
from lm_eval.tasks import TaskManager

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny-moe"
MC = [  # context, choices, gold: choices far apart in likelihood, so int4 experts keep the ranking
    ("def add(a, b):\n    return", [" a + b", " 42 42 42 )", " class class"], 0),
    ("import os\nimport", [" sys", " ((((", " 1 1 1 1"], 0),
    ("for i in range(10):\n   ", [" print(i)", " ]]]] ))", " else else"], 0),
    ("# the sum of a list\ntotal =", [" sum(values)", " :: :: ::", " import import"], 0),
]
GEN = [("def add(a, b):\n", "    return a + b"), ("import os\n", "import sys"), ("x = 1\n", "y = 2")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _serve(engine):
    import uvicorn

    from fate_edge.apps.engine_args import EngineOptions
    from fate_edge.apps.server import ServerSettings, create_app

    app = create_app(ServerSettings(engine=EngineOptions(device="cpu")), engine=engine)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory, bundled_dir):
    """Two tasks from local jsonl files, and lm-eval's task manager over their folder (offline: nothing fetched)."""
    root = tmp_path_factory.mktemp("lm-eval-tasks")
    (root / "mc.jsonl").write_text("".join(json.dumps({"q": c, "choices": ch, "gold": g}) + "\n" for c, ch, g in MC))
    (root / "gen.jsonl").write_text("".join(json.dumps({"q": c, "a": a}) + "\n" for c, a in GEN))
    common = "dataset_path: json\ntest_split: test\ndoc_to_text: '{{q}}'\n"
    (root / "fe_mc.yaml").write_text(
        f"task: fe_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{gold}}'\ntarget_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n"
    )
    (root / "fe_gen.yaml").write_text(
        f"task: fe_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_target: '{{a}}'\ntarget_delimiter: ''\n"
        'generation_kwargs:\n  until: ["\\n\\n"]\n  max_gen_toks: 8\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"
    )
    with pytest.MonkeyPatch.context() as mp:
        for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            mp.setenv(var, "1")
        yield TaskManager(include_path=str(root), include_defaults=False)


def _evaluate(tasks, model: str, args: dict, names: list[str], **kw) -> dict:
    return simple_evaluate(
        model=model, model_args=args, tasks=names, task_manager=tasks, log_samples=True, limit=None, **kw
    )


def _completions_args(base: str, bundled_dir: Path) -> dict:
    return {
        "base_url": f"{base}/v1/completions",
        "model": MODEL,
        "tokenizer": str(bundled_dir),
        "tokenizer_backend": "huggingface",
        "tokenized_requests": True,
        "num_concurrent": 1,
        "max_retries": 1,
    }


def _direct(engine, context: str, continuation: str) -> float:
    """The continuation's log-likelihood after the context, from one forward of the engine's model, for the request
    lm-eval makes of the pair: the context's trailing whitespace moved to the continuation, then the context's tokens
    and the rest of the whole string's (its documented convention; the third question's context ends in spaces)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    tok = engine.tokenizer
    ctx, whole = tok.encode(context), tok.encode(context + continuation)
    with engine._lock, torch.inference_mode():  # the last token predicts nothing scored: not run (as the daemon)
        logits = engine.model(torch.tensor([whole[:-1]]), engine.model.new_cache())[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return sum(float(lp[i - 1, whole[i]]) for i in range(len(ctx), len(whole)))


def _scores(out: dict) -> list[list[float]]:
    samples = sorted(out["samples"]["fe_mc"], key=lambda s: s["doc_id"])
    return [[float(r[0][0]) for r in s["resps"]] for s in samples]


@pytest.fixture(scope="module")
def fp32_engine(baseline_store):
    from fate_edge import Engine
    from fate_edge.runtime.policy import get_policy

    policy = get_policy("lru").with_(bits=16)  # the store's bf16 experts computed in fp32, every one cached
    with Engine.load(baseline_store, memory_budget="64MB", device="cpu", dtype="float32", policy=policy) as eng:
        yield eng


def test_local_completions_loglikelihood_equals_the_model_directly_and_generate_until_runs(
    tasks, fp32_engine, bundled_dir
):
    with _serve(fp32_engine) as base:
        out = _evaluate(tasks, "local-completions", _completions_args(base, bundled_dir), ["fe_mc", "fe_gen"])
    scores = _scores(out)
    direct = [[_direct(fp32_engine, c, ch) for ch in choices] for c, choices, _ in MC]
    for got, want in zip(scores, direct):
        assert got == pytest.approx(want, abs=1e-4)
        assert all(math.isfinite(s) and s < 0 for s in got)
    assert out["results"]["fe_mc"]["acc,none"] == sum(
        max(range(3), key=d.__getitem__) == g for d, (_, _, g) in zip(direct, MC)
    ) / len(MC)
    gens = sorted(out["samples"]["fe_gen"], key=lambda s: s["doc_id"])
    assert len(gens) == len(GEN)
    for s, (context, _) in zip(gens, GEN):  # greedy: the daemon's own answer to the same request
        text, _ = fp32_engine.generate_text(context, _greedy(8))
        assert s["resps"][0][0] == text.split("\n\n")[0]
    assert 0.0 <= out["results"]["fe_gen"]["exact_match,none"] <= 1.0


def _greedy(n: int):
    from fate_edge import GenerateConfig

    return GenerateConfig(max_tokens=n)


def test_int4_experts_keep_the_fp32_ranking(tasks, fp32_engine, bundled_dir):
    from fate_edge import Engine

    reference = [[_direct(fp32_engine, c, ch) for ch in choices] for c, choices, _ in MC]
    # int4 experts, every one cached after its first read: each score is the checkpoint's own (no int2 prefetch
    # tail, whose reads would make a score depend on what the cache held)
    kw = dict(memory_budget="64MB", device="cpu", dtype="float32", policy="lru")
    with Engine.load(None, **kw) as int4, _serve(int4) as base:
        assert int4.policy.bits == 4
        scores = _scores(_evaluate(tasks, "local-completions", _completions_args(base, bundled_dir), ["fe_mc"]))
        direct = [[_direct(int4, c, ch) for ch in choices] for c, choices, _ in MC]
    for got, own, ref in zip(scores, direct, reference):
        assert got == pytest.approx(own, abs=1e-4)  # the int4 checkpoint's own scores, exactly served
        assert sorted(range(3), key=got.__getitem__) == sorted(range(3), key=ref.__getitem__)


def test_local_chat_completions_generate_until_runs_through_the_chat_template(tasks, fp32_engine):
    args = {"base_url": None, "model": MODEL, "num_concurrent": 1, "max_retries": 1, "tokenized_requests": False}
    with _serve(fp32_engine) as base:
        args["base_url"] = f"{base}/v1/chat/completions"
        out = _evaluate(tasks, "local-chat-completions", args, ["fe_gen"], apply_chat_template=True)
    gens = sorted(out["samples"]["fe_gen"], key=lambda s: s["doc_id"])
    assert len(gens) == len(GEN)
    tok = fp32_engine.tokenizer
    for s, (context, _) in zip(gens, GEN):
        prompt = tok.apply_chat_template([{"role": "user", "content": context}], add_generation_prompt=True)
        text, _ = fp32_engine.generate_text(prompt, _greedy(8))
        assert s["resps"][0][0] == text.split("\n\n")[0]
