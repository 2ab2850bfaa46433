"""The CLI's engine helper, defaults, help, --version, --threads and the planner's progress under --policy auto."""

import argparse
import re

import pytest
import torch

from fate_edge import defaults
from fate_edge.apps.cli import build_parser, main
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.generate import GenerateConfig
from fate_edge.runtime.policy import POLICY_CHOICES


def test_run_closes_the_engine_when_generation_fails_midway(monkeypatch, capsys):
    closed = []
    real_close, real_stream = Engine.close, Engine.stream

    def failing_stream(self, prompt, config=None):
        steps = real_stream(self, prompt, config)
        yield next(steps)
        steps.close()
        raise RuntimeError("read failed mid-generation")

    monkeypatch.setattr(Engine, "stream", failing_stream)
    monkeypatch.setattr(Engine, "close", lambda self: (closed.append(self), real_close(self)))
    with pytest.raises(RuntimeError, match="mid-generation"):
        main(["run", "--memory-budget", "4MB", "--max-tokens", "4", "def "])
    assert len(closed) == 1


def test_one_default_budget_and_policy_everywhere():
    sub = {name: p for name, p in build_parser()._subparsers._group_actions[0].choices.items()}
    for cmd in ("chat", "serve"):
        defaults_of = {a.dest: a.default for a in sub[cmd]._actions}
        assert defaults_of["memory_budget"] == defaults.MEMORY_BUDGET and defaults_of["policy"] == defaults.POLICY
    import inspect

    load = inspect.signature(Engine.load).parameters
    assert load["memory_budget"].default == defaults.MEMORY_BUDGET and load["policy"].default == defaults.POLICY


def test_run_without_budget_uses_the_shared_default(monkeypatch, capsys):
    assert defaults.MEMORY_BUDGET == "auto"
    assert main(["run", "--policy", "lru", "--max-tokens", "2", "--ignore-eos", "def "]) == 0
    err = capsys.readouterr().err
    chosen = re.search(r"\[memory\] expert budget auto: (\d+) MB \(", err)
    assert chosen is not None, err  # one line saying what auto chose and why, before the account
    assert re.search(rf"expert budget +{chosen.group(1)} MB +cache, read buffers", err)  # the account used it


def test_run_threads_sets_torch_threads_and_the_default_leaves_the_fetch_worker_its_core(capsys):
    before = torch.get_num_threads()
    try:  # the bundled model is too narrow to gain from every core (runtime.auto_threads)
        assert main(["run", "--max-tokens", "1", "def "]) == 0
        assert torch.get_num_threads() == defaults.STREAMING_THREADS
        assert main(["run", "--threads", "3", "--max-tokens", "1", "def "]) == 0
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_version_and_help_list_every_policy_and_auto(capsys):
    from fate_edge import __version__

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and __version__ in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert all(name in out for name in POLICY_CHOICES) and "expert store" in out and "Ollama name" in out


def test_policy_auto_reports_probes_pick_and_predicted_speed(monkeypatch, capsys):
    from fate_edge.planning import planner

    real = planner.auto_plan
    calls = []

    def quick(*a, **kw):  # the real planner, on fewer tokens
        calls.append(kw.get("progress"))
        return real(*a, **kw, decode_tokens=4, prompt_tokens=16)

    monkeypatch.setattr(planner, "auto_plan", quick)
    assert main(["run", "--policy", "auto", "--memory-budget", "4MB", "--max-tokens", "2", "def "]) == 0
    err = capsys.readouterr().err
    assert calls and calls[0] is not None
    # the LRU probe and the host preset's (which runs the predictor): two probes, numbered
    assert "[planner] probe 1/2" in err and "[planner] probe 2/2" in err and "simulating" in err
    assert "[planner] picked" in err and "decode tok/s" in err and "policy planned" in err


def test_resident_bits_reach_the_engine_from_the_command_line(bundled_dir, tmp_path, monkeypatch):
    from fate_edge.apps.engine_args import EngineOptions, add_engine_args, open_engine

    monkeypatch.setenv("FATE_EDGE_CACHE", str(tmp_path / "cache"))
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(
        ["--model", str(bundled_dir), "--memory-budget", "2MB", "--device", "cpu", "--resident-bits", "8"]
    )
    opts = EngineOptions.from_args(args)
    assert opts.resident_bits == 8
    with open_engine(opts, progress=False) as engine:
        kernels = engine.model.kernels()
        assert {k for role in ("qkv", "o_proj", "lm_head") for k in kernels[role]} == {"torch-int8"}
        text, _ = engine.generate_text("def add(a, b):", GenerateConfig(max_tokens=4))
        assert text
