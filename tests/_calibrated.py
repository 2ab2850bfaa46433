"""A copy of the bundled model calibrated here in seconds (tiny corpus, rank 8, 2 epochs), for engine tests of
calibrate options."""

from __future__ import annotations

import shutil
from pathlib import Path

from _tiny_moe import CORPUS

from fate_edge.planning.calibrate import CalibrateOptions, calibrate


def calibrated_bundled_copy(bundled_dir: Path, tmp_path: Path, monkeypatch, **options) -> tuple[Path, dict]:
    """The bundled model copied without its shipped predictors and calibrated with ``options`` (a private cache:
    the predictors land in the expert store the engine opens); returns (model dir, calibration report)."""
    monkeypatch.setenv("FATE_EDGE_CACHE", str(tmp_path / "cache"))
    model_dir = tmp_path / "model"
    shutil.copytree(bundled_dir, model_dir, ignore=shutil.ignore_patterns("predictors"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(CORPUS))
    report = calibrate(
        model_dir,
        CalibrateOptions(
            corpus=corpus, tokens=2048, seq_len=64, lookahead=1, rank=8, epochs=2, onnx=False, progress=False, **options
        ),
    )
    return model_dir, report


def spy_model_inputs(predictor, monkeypatch) -> list:
    """Wrap ``predictor.predict`` so each call also records (layer, what its source model reads: the widened
    input) into the returned list."""
    seen: list = []
    real_predict = predictor.predict

    def predict(layer, h):
        seen.append((layer, predictor.model_input(layer, h).clone()))
        return real_predict(layer, h)

    monkeypatch.setattr(predictor, "predict", predict)
    return seen


def calibrated_baseline_store(model_dir: Path) -> Path:
    """The baselines' store of a calibrated model (the bf16 and int2 copies, asked for), with the predictors that
    calibrate wrote into the default store the engine opens."""
    from fate_edge.format.converted_stores import ensure_store

    lean = ensure_store(model_dir, progress=False)
    store = ensure_store(model_dir, cold_bits=2, progress=False, baselines=True)
    shutil.copytree(lean / "predictors", store / "predictors", dirs_exist_ok=True)
    return store
