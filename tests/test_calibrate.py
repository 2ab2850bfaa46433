"""fate_edge/planning/calibrate.py: ``fate-edge calibrate`` end to end on the tiny random model and a tiny corpus."""

import argparse
import json
import os
import shutil

import pytest
import torch
from _tiny_moe import CORPUS, build_tiny_moe
from fate_edge.predictors import ActivationPathPredictor, LearnedPredictor, OnnxPredictor, TokenPopularity

from fate_edge import Engine
from fate_edge.apps.calibrate_cli import add_calibrate_parser
from fate_edge.bundled import bundled_model_dir
from fate_edge.errors import CalibrationError
from fate_edge.format.popularity import load_popularity
from fate_edge.planning.calibrate import CalibrateOptions, calibrate, trace_windows, trained_on_stdlib
from fate_edge.runtime.loader import load_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("calibrate")
    model_dir = build_tiny_moe(root / "tiny-moe")
    corpus = root / "corpus.txt"
    corpus.write_text("".join(CORPUS))
    return model_dir, corpus


def parse(argv):
    parser = argparse.ArgumentParser(prog="fate-edge")
    add_calibrate_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


@pytest.mark.slow
def test_calibrate_command_end_to_end(tiny, tmp_path, capsys):
    model_dir, corpus = tiny
    pred_dir = tmp_path / "predictors"  # the tiny model's 16-wide experts cannot be grouped into a store
    args = parse(
        [
            "calibrate",
            str(model_dir),
            "--corpus",
            str(corpus),
            "--tokens",
            "2048",
            "--seq-len",
            "64",
            "--lookahead",
            "2",
            "--rank",
            "8",
            "--epochs",
            "5",
            "--out",
            str(tmp_path),
            "--predictors-dir",
            str(pred_dir),
            "--quiet",
        ]
    )
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "| learned-lowrank | 0 → 1 |" in printed and "| token-popularity | tok → 0 |" in printed

    report = json.loads((tmp_path / "calibration.json").read_text())
    k = report["k"]
    assert report["widths"] == list(range(k, k + 5)) and report["lookahead"] == 2
    assert report["bytes_per_expert"] == 3 * 32 * 16 * 2  # 3·H·I·2 (bf16)
    names = {"cross-layer-gate", "cross-layer-gate-norm", "learned-linear", "learned-lowrank", "token-popularity"}
    assert set(report["predictors"]) == names
    moe = report["moe_layers"]
    sim = report["gate_input_similarity"]
    assert [(r["source"], r["target"]) for r in sim] == list(zip(moe, moe[1:])) + list(zip(moe, moe[2:]))
    assert all(-1 <= r["cosine_p10"] <= r["cosine"] <= 1 for r in sim)
    assert "Gate-input cosine similarity" in printed
    for name in names - {"token-popularity"}:
        rows = report["predictors"][name]["rows"]
        assert {(r["source"], r["target"], r["distance"]) for r in rows} == {(0, 1, 1), (0, 3, 2), (1, 3, 1)}
        for r in rows:
            recalls = [r["recall"][str(w)] for w in report["widths"]]
            assert recalls == sorted(recalls) and 0 <= r["exact"] <= recalls[0]
            assert r["tokens"] == report["corpus"]["heldout_tokens"]
        assert [m["distance"] for m in report["predictors"][name]["mean"]] == [1, 2]
    (tok_row,) = report["predictors"]["token-popularity"]["rows"]
    assert (tok_row["source"], tok_row["target"]) == (-1, 0)

    assert not (model_dir / "predictors").exists()  # the model folder is not written
    popularity = load_popularity(pred_dir / "popularity.json")
    assert sorted(popularity) == [0, 1, 3]
    assert all(sum(c) == report["corpus"]["train_tokens"] * k for c in popularity.values())
    ActivationPathPredictor([0, 1, 3], 8, popularity=popularity)  # seeds the activation-path baseline
    assert TokenPopularity.load(pred_dir / "token-popularity.safetensors").targets(-1) == (0,)
    for kind in ("linear", "lowrank"):
        path = pred_dir / f"learned-{kind}-p2.json"
        manifest = json.loads(path.read_text())
        assert (
            manifest["training"]["train_tokens"] + manifest["training"]["val_tokens"]
            == report["corpus"]["train_tokens"]
        )
        assert len(manifest["metrics"]["heldout"]) == 3
        h = torch.randn(3, 32)
        onnx, torch_ = OnnxPredictor(path).predict(0, h), LearnedPredictor.load(path).predict(0, h)
        torch.testing.assert_close(onnx.scores, torch_.scores, atol=1e-5, rtol=0)


def _set_mode(root, files: int, dirs: int) -> None:
    for path in [*root.rglob("*"), root]:
        os.chmod(path, dirs if path.is_dir() else files)


def test_calibrating_a_read_only_model_gives_the_engine_its_learned_predictor(tiny, tmp_path, capsys, bundled_dir):
    _, corpus = tiny
    ro = tmp_path / "read-only-model"  # the bundled model (a store can be made of it) without its predictors
    shutil.copytree(bundled_dir, ro, ignore=shutil.ignore_patterns("predictors"))
    before = {p.relative_to(ro): p.stat().st_mtime_ns for p in ro.rglob("*")}
    _set_mode(ro, 0o444, 0o555)
    try:
        args = parse(
            [
                "calibrate",
                str(ro),
                "--corpus",
                str(corpus),
                "--tokens",
                "2048",
                "--seq-len",
                "64",
                "--lookahead",
                "1",
                "--rank",
                "8",
                "--epochs",
                "3",
                "--no-onnx",
                "--quiet",
            ]
        )
        assert args.func(args) == 0
        printed = capsys.readouterr().out
        # Checked by content, not only by permission: root may write to a read-only folder.
        assert {p.relative_to(ro): p.stat().st_mtime_ns for p in ro.rglob("*")} == before
        with Engine.load(ro, "64MB", policy="fate-edge") as engine:  # best-available: learned when calibrated
            assert isinstance(engine.scheduler.predictor, LearnedPredictor)
            assert engine.popularity is not None
            store_predictors = engine.store.path / "predictors"
        assert f"predictors and popularity in {store_predictors} (the expert store the engine uses" in printed
    finally:
        _set_mode(ro, 0o644, 0o755)


def test_a_model_our_training_script_made_calibrates_on_its_own_stdlib_split(tiny, tmp_path):
    model_dir, _ = tiny
    trained = tmp_path / "trained"
    shutil.copytree(model_dir, trained)
    # What scripts/train_tiny_moe.py writes: the split settings and the corpus it read (a small corpus cap).
    log = {
        "config": {"heldout_fraction": 0.2, "max_corpus_bytes": 1_000_000},
        "complete": True,
        "corpus": "Python 3.11 standard library .py files",
    }
    (trained / "training_log.json").write_text(json.dumps(log))
    report = calibrate(
        trained,
        CalibrateOptions(
            tokens=1024, seq_len=64, rank=4, epochs=1, onnx=False, predictors_dir=tmp_path / "p", progress=False
        ),
    )
    assert report["corpus"]["source"].startswith("Python stdlib .py files")
    assert report["corpus"]["train_files"] > 0 and report["corpus"]["heldout_tokens"] > 0
    assert trained_on_stdlib(bundled_model_dir())  # the shipped model's own log is what gives it a default corpus
    (trained / "training_log.json").write_text(json.dumps({**log, "corpus": "my own text"}))
    with pytest.raises(CalibrationError, match="--corpus FILE is required"):
        calibrate(trained, CalibrateOptions(predictors_dir=tmp_path / "p"))


def test_calibrate_needs_a_corpus_for_other_models(tiny, tmp_path):
    model_dir, corpus = tiny
    with pytest.raises(CalibrationError, match="--corpus"):
        calibrate(model_dir, CalibrateOptions(predictors_dir=tmp_path))
    with pytest.raises(CalibrationError, match="fewer than 2 windows"):
        calibrate(model_dir, CalibrateOptions(corpus=corpus, seq_len=4096, predictors_dir=tmp_path, progress=False))
    with pytest.raises(CalibrationError, match="heldout-fraction"):
        calibrate(model_dir, CalibrateOptions(corpus=corpus, heldout_fraction=1.0, predictors_dir=tmp_path))
    with pytest.raises(CalibrationError, match="cannot open this model as an expert store.*--predictors-dir"):
        calibrate(model_dir, CalibrateOptions(corpus=corpus, progress=False))  # default: the engine's store
    with pytest.raises(CalibrationError, match="no such corpus"):
        calibrate(model_dir, CalibrateOptions(corpus=tmp_path / "missing.txt", predictors_dir=tmp_path))


def test_traces_are_kept_in_half_precision_unless_a_gate_input_overflows_it(tiny, capsys):
    """calibrate keeps gate inputs in float16 (half the memory of a long corpus); a model whose gate inputs
    exceed float16's range is traced again in float32, not trained on infinities."""
    model = load_model(tiny[0])
    wins = torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    half = trace_windows(model, wins, 2, "tracing", progress=False, early=True)
    assert {h.dtype for h in [*half.gate_inputs.values(), *half.early_inputs.values()]} == {torch.float16}
    model.plan()[0].post_norm.mul_(1e6)  # layer 0's gate input: ~1e6, past float16's 65504
    full = trace_windows(model, wins, 2, "tracing", progress=False, early=True)
    assert full.gate_inputs[0].dtype == torch.float32 and torch.isfinite(full.gate_inputs[0]).all()
    assert full.gate_inputs[0].abs().max() > 65504
    assert "overflows float16; tracing again in float32" in capsys.readouterr().err


def test_gate_input_similarity_is_the_mean_cosine_per_token():
    from fate_edge.predictors.evaluate import Trace

    from fate_edge.planning.gate_similarity import gate_input_similarity

    g = torch.Generator().manual_seed(0)
    h0 = torch.randn(1000, 16, generator=g)
    other = torch.randn(1000, 16, generator=g)
    other -= (other * h0).sum(-1, keepdim=True) / h0.pow(2).sum(-1, keepdim=True) * h0  # orthogonal to h0, per row
    inputs = {1: h0.half(), 2: (3 * h0).half(), 3: other.half(), 5: (-h0).half()}
    trace = Trace(inputs, {i: torch.zeros(1000, 2, dtype=torch.long) for i in inputs}, 8)
    rows = {(r["source"], r["target"]): r for r in gate_input_similarity(trace, [1, 2, 3, 5], 2)}
    assert set(rows) == {(1, 2), (2, 3), (3, 5), (1, 3), (2, 5)}
    assert rows[(1, 2)]["cosine"] == pytest.approx(1, abs=1e-3) and rows[(1, 2)]["distance"] == 1
    assert rows[(2, 3)]["cosine"] == pytest.approx(0, abs=2e-3) and rows[(1, 3)]["distance"] == 2
    assert rows[(2, 5)]["cosine"] == pytest.approx(-1, abs=1e-3) and rows[(2, 5)]["cosine_p10"] <= -0.99
