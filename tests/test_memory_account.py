"""The memory account (fate_edge.runtime.memory_account): its parts are what an Engine holds, and its predicted peak is
within 10% of the peak RSS measured on a synthetic Qwen1.5-MoE slice (real vocabulary, widths / 4)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge.runtime.memory_account import kv_bytes_per_token, memory_account
from fate_edge_lab.synthetic import SyntheticOptions, make_synthetic_model

SCRIPT = Path(__file__).resolve().parents[1] / "research" / "measure_memory.py"


@pytest.fixture(scope="module")
def bundled_store(tmp_path_factory, bundled_dir):
    return convert(
        bundled_dir, tmp_path_factory.mktemp("acct") / "s", ConvertOptions.full(bits=4, keep_bf16=False), progress=False
    )


@pytest.fixture(scope="module")
def qwen_slice(tmp_path_factory):
    """2 layers of Qwen1.5-MoE-A2.7B at a quarter of its widths: a 151936-token vocabulary of width 512, so the
    embedding table (156 MB in bf16) weighs as it does at real shapes against the rest."""
    root = tmp_path_factory.mktemp("qwen-slice")
    make_synthetic_model(root / "ckpt", SyntheticOptions("qwen1.5-moe-a2.7b", layers=2, scale=4))
    opts = dict(bits=4, keep_bf16=False, threads=2)
    return {
        "float": convert(root / "ckpt", root / "store", ConvertOptions.full(**opts), progress=False),
        "int4 at convert": convert(
            root / "ckpt", root / "pq", ConvertOptions.full(**opts, resident_bits=4, embedding_bits=4), progress=False
        ),
    }


@pytest.mark.parametrize("resident_bits", [None, 4])
def test_the_resident_parts_are_what_the_engine_loads(bundled_store, resident_bits, one_thread):
    account = memory_account(bundled_store, 3_000_000, "bfloat16", 100, resident_bits)
    with Engine(EngineConfig(bundled_store, 3_000_000, "lru", dtype="bfloat16", resident_bits=resident_bits)) as engine:
        loaded = sum(t.numel() * t.element_size() for t in engine.model.w.values())
        embed = engine.model.embed.numel() * engine.model.embed.element_size()
        cache = engine.model.new_cache()
        with torch.no_grad():
            engine.model.forward(torch.arange(100).unsqueeze(0), cache, last_only=True)
    assert (account.embeddings, account.embeddings + account.other_resident) == (embed, loaded)
    assert cache.nbytes == kv_bytes_per_token(engine.model.config, torch.bfloat16) * 100  # a 100-token prompt
    assert cache.nbytes <= account.kv_cache
    assert account.peak == account.runtime + max(account.loading, account.running)


@pytest.mark.parametrize("store, resident_bits", [("float", None), ("float", 4), ("int4 at convert", None)])
@pytest.mark.slow
def test_the_measured_peak_is_within_ten_percent_of_the_prediction(qwen_slice, store, resident_bits):
    cmd = [
        sys.executable,
        str(SCRIPT),
        str(qwen_slice[store]),
        "--memory-budget",
        "40MB",
        "--prompt-tokens",
        "512",
        "--max-tokens",
        "8",
    ] + ([] if resident_bits is None else ["--resident-bits", str(resident_bits)])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["measured"] <= 1.10 * result["predicted"], out.stdout
    assert result["measured"] >= 0.90 * result["predicted"], out.stdout


def test_a_run_that_cannot_fit_is_refused_before_anything_loads(bundled_store, monkeypatch):
    import fate_edge.runtime.engine as engine_module

    account = memory_account(bundled_store, 3_000_000, "bfloat16", 4096, prompt_cache="auto")  # the engine's default
    free = account.to_load - 2_000_000  # 2 MB short, less than the budget: lowering it is the fix

    def must_not_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(engine_module, "available_memory_bytes", lambda: free)
    monkeypatch.setattr(engine_module, "load_model", must_not_load)
    with pytest.raises(engine_module.BudgetError) as info:
        Engine(EngineConfig(bundled_store, 3_000_000, "lru", dtype="bfloat16", device="cpu"))
    message = str(info.value)
    assert "\n" not in message
    assert f"only {free / 1e6:.0f} MB is free" in message
    assert f"embeddings {account.embeddings / 1e6:.0f} + other resident weights" in message
    assert "lower --memory-budget to 1 MB" in message


def test_a_run_that_fits_is_not_refused(bundled_store, monkeypatch):
    import fate_edge.runtime.engine as engine_module

    account = memory_account(bundled_store, 3_000_000, "bfloat16", 4096, prompt_cache="auto")
    monkeypatch.setattr(engine_module, "available_memory_bytes", lambda: account.to_load + 50_000_000)
    with Engine(EngineConfig(bundled_store, 3_000_000, "lru", dtype="bfloat16", device="cpu")) as engine:
        assert engine.account.expert_budget == 3_000_000


def test_inspect_prints_the_account_by_part(bundled_store, capsys):
    from fate_edge.apps.cli import main

    assert (
        main(
            [
                "inspect",
                str(bundled_store),
                "--memory-budget",
                "3MB",
                "--resident-bits",
                "4",
                "--dtype",
                "bfloat16",
                "--context-tokens",
                "512",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    account = memory_account(bundled_store, 3_000_000, "bfloat16", 512, 4)
    part = {line[2:25].strip(): line[25:36].strip() for line in out.splitlines() if line.startswith("  ")}
    assert part["embeddings"] == f"{account.embeddings / 1e6:.0f} MB"
    assert part["other resident weights"] == f"{account.other_resident / 1e6:.0f} MB"
    assert part["expert budget"] == "3 MB"
    assert part["KV cache"] == f"{account.kv_cache / 1e6:.0f} MB"
    assert part["predicted peak RSS"].endswith("MB")


def test_run_prints_the_account_before_loading(capsys):
    from fate_edge.apps.cli import main

    assert main(["run", "--memory-budget", "2MB", "--context-tokens", "256", "--max-tokens", "2", "def"]) == 0
    err = capsys.readouterr().err
    assert err.index("[memory] predicted peak RSS by part:") < err.index("prompt tokens at")
    assert "  KV cache" in err and "256 tokens" in err and "  predicted peak RSS" in err
