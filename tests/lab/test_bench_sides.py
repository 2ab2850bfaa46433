"""``fate-edge bench-llamacpp``'s sides: which store each fate-edge side reads, and a side stopped at the timeout
reported as what it measured (fate_edge_lab.bench.sidebyside, llamacpp_cli, threads.run_child)."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from safetensors.torch import load_file, save_file

from fate_edge import bundled_model_dir
from fate_edge_lab.bench import sidebyside as sbs
from fate_edge_lab.bench.llamacpp_cli import table
from fate_edge_lab.bench.threads import run_child


@pytest.fixture
def tied_model(tmp_path, monkeypatch):
    """The bundled model with its output tied to the embedding table (as ERNIE-4.5 and LFM2 are): no lm_head."""
    monkeypatch.setenv("FATE_EDGE_CACHE", str(tmp_path / "cache"))  # the converted stores
    dst = tmp_path / "tiny-tied"
    shutil.copytree(bundled_model_dir(), dst, ignore=shutil.ignore_patterns("predictors"))
    weights = load_file(dst / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, dst / "model.safetensors", {"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(cfg | {"tie_word_embeddings": True}))
    return dst


def _side(name: str) -> sbs.Side:
    real = sbs.SIDE_SETS["real"]
    return next(s for s in real.resident + real.limited if s.name == name)


def test_int4_rest_sides_read_the_store_a_default_run_converts(tied_model):
    """The int4-rest sides ran on the baselines' store with the resident weights quantized at load, which left a
    tied embedding table in bf16: 530 MB multiplied whole every token at ERNIE-4.5's size, where a user's run (and
    llama.cpp) reads a quantized one. They read the store ``fate-edge run`` converts: the table in int4."""
    from fate_edge.apps.engine_args import resolve_store

    names = ["fate-edge int4, int4 rest", "fate-edge int4, expert budget", "fate-edge int4, bf16 rest"]
    sides = [_side(n) for n in names]
    stores = sbs.side_stores(tied_model, sides)
    base = {"model": str(tied_model), "ids": [1, 2, 3], "threads": 1, "decode_tokens": 2, "budget": 10**6}
    specs = {s.name: sbs.side_spec(base, s, {}, stores) for s in sides}
    default = resolve_store(tied_model, progress=False)  # what `fate-edge run MODEL` converts and reads
    for name in names[:2]:
        assert specs[name]["store"] == str(default), name
    index = json.loads((default / "store.json").read_text())
    assert (index["resident_bits"], index["embedding_bits"]) == (4, 4)  # the tied table at the head's precision
    # the bf16-rest side quantizes nothing resident: the baselines' store, bf16 experts kept
    baselines = json.loads((sbs.Path(specs["fate-edge int4, bf16 rest"]["store"]) / "store.json").read_text())
    assert baselines["embedding_bits"] is None and "16" in baselines["precisions"]
    for name in names[:2]:  # both load and decode as the child runs them
        spec = specs[name] | {"workers": 1}
        assert len(list(sbs._fate_edge_stream(spec))) == 3, name


def test_the_stores_converted_are_only_those_the_sides_read(tied_model):
    stores = sbs.side_stores(tied_model, [_side("fate-edge int4, int4 rest"), _side("llama.cpp q4_0")])
    assert list(stores) == [sbs.DEFAULT]
    made = [p for p in (tied_model.parent / "cache" / "stores").iterdir() if not p.name.startswith(".")]
    assert made == [stores[sbs.DEFAULT]]  # no baselines' store: at real size its bf16 experts fill a disk


_SLOW_CHILD = (
    "import json, sys, time\n"
    "print(json.dumps({'progress': {'prompt_tokens': 64, 'want': 33, 'tokens': 0, 'start': time.time()}}),"
    " flush=True)\n"
    "time.sleep(60)\n"
)


def test_a_child_stopped_at_the_timeout_reports_how_long_what_it_read_and_how_far_it_got():
    res = run_child([sys.executable, "-c", _SLOW_CHILD], timeout=2)
    assert res["error"].startswith("did not finish in 2 s") and res["timed_out_s"] == 2
    assert res["progress"]["tokens"] == 0 and res["read_bytes"] is not None  # /proc/PID/io, read before the kill


def test_a_side_that_did_not_finish_is_a_measured_row_and_is_not_run_again(monkeypatch):
    """llama.cpp under the cap on Qwen3-Next's slice read 206 GB in 204 s without finishing: the table had no row
    for it. It gets one: the rates it stayed below and what it read, and the fate-edge side's ratio as a bound."""
    from fate_edge_lab.bench import threads

    ours, theirs = _side("fate-edge int4, int4 rest"), _side("llama.cpp q4_0")
    calls: list[str] = []

    def fake_run_child(cmd, timeout, env=None, preexec=None):
        spec = json.loads(open(cmd[-1]).read())
        calls.append(spec["kind"])
        if spec["kind"] == "fate-edge":
            return {
                "prefill_tps": 320.0,
                "decode_tps": 26.0,
                "decode_cpu_tps": 26.0,
                "tokens": [1],
                "peak_rss_bytes": 1,
            }
        return {
            "error": "did not finish in 100 s, 50.0 GB read",
            "timed_out_s": 100.0,
            "stopped_at": 1100.0,
            "read_bytes": 50 * 10**9,
            "progress": {"prompt_tokens": 64, "want": 33, "tokens": 0, "start": 1020.0},
        }

    monkeypatch.setattr(threads, "run_child", fake_run_child)
    base = {"model": "m", "ids": [1], "text": "", "text_ids": [], "threads": 1, "decode_tokens": 32, "budget": 1}
    runs, _ = sbs.run_rounds(
        base, [ours, theirs], {"q4_0": "x.gguf"}, 3, 100.0, {sbs.DEFAULT: sbs.Path("s")}, log=lambda m: None
    )
    assert calls == ["fate-edge", "llama.cpp", "fate-edge", "fate-edge"]  # stopped once, not run again
    summary = sbs.summarize(runs, [ours, theirs], [(ours.name, theirs.name)])
    assert summary[theirs.name]["unfinished"]["prefill_tps_below"] == pytest.approx(64 / 80)
    assert summary[ours.name]["prefill_tps_ratio_above"] == pytest.approx(320 / 0.8)
    row = [ln for ln in table(summary, "").splitlines() if ln.startswith(f"| {theirs.name}")][0]
    assert "did not finish in 100 s: prefill not done" in row and "| < 0.8 |" in row and "50.0 GB in 100 s" in row
    assert "| > 400 |" in table(summary, "")


def test_a_side_stopped_after_its_first_token_keeps_its_prefill_and_bounds_its_decode():
    run = {
        "timed_out_s": 100.0,
        "stopped_at": 1100.0,
        "read_bytes": None,
        "progress": {"prompt_tokens": 64, "want": 33, "tokens": 5, "start": 1000.0, "first": 1080.0},
    }
    u = sbs.unfinished(run)
    assert u["prefill_tps"] == pytest.approx(64 / 80) and u["decode_tps_below"] == pytest.approx(5 / 20)
