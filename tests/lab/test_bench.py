"""The benchmark's core on a tiny configuration: JSON structure, same-run ratios, identical greedy tokens.

Runs in one process (``isolate=False``: the per-configuration subprocesses only add peak-RSS isolation) on
the bundled model, not inflated: one budget, one emulated link, a 16-token prompt, 8 decode tokens, 1 run.

Token identity holds for every preset that computes with int4 experts only. ``fate`` is left out: its
prefill sends the least popular experts as int2 (Fate's cold tail), which can change the answer; the
benchmark reports that per configuration (``tokens_match_int4_reference``) instead of asserting it.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fate_edge_lab.bench.cli import add_arguments, config_from_args, invoked_command
from fate_edge_lab.bench.config import ALL_PRESETS, LINKS, BenchConfig
from fate_edge_lab.bench.outputs import (
    README_BEGIN,
    README_END,
    check_readme,
    output_paths,
    update_readme,
    write_outputs,
)
from fate_edge_lab.bench.run import run_bench

PRESETS = ["load-on-demand-int4", "fate-edge", "oracle"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, bundled_dir):
    from fate_edge.format.converted_stores import ensure_store

    tmp = tmp_path_factory.mktemp("bench")
    store = ensure_store(
        bundled_dir, cold_bits=2, progress=False, baselines=True
    )  # int4 + int2 + bf16, converted once, shared with other tests
    cfg = BenchConfig(
        model=str(store),
        presets=PRESETS,
        budgets=[0.35],
        links=["orin-nano-nvme"],
        prompt_tokens=[16],
        decode_tokens=8,
        runs=2,
        threads=2,
        peers=False,
        planner=True,
        out_dir=str(tmp / "out"),
        work_dir=str(tmp / "work"),
        plot_path=str(tmp / "out" / "bench.png"),
        isolate=False,
    )
    result = run_bench(cfg)
    paths = write_outputs(result, cfg)
    return cfg, result, paths


@pytest.mark.slow
def test_json_structure(tiny_run):
    cfg, result, paths = tiny_run
    saved = json.loads(paths["json"].read_text())
    for key in (
        "date",
        "machine",
        "threads",
        "model",
        "prompts",
        "links",
        "results",
        "peers",
        "skipped_presets",
        "int4_reference_tokens",
    ):
        assert key in saved, key
    assert saved["threads"]["torch"] == 2
    assert saved["prompts"]["lengths"] == [16] and saved["prompts"]["decode_tokens"] == 8
    assert saved["links"]["orin-nano-nvme"]["check"]["spec_gbps"] == pytest.approx(3.0)
    assert saved["skipped_presets"] == {}
    runs = {r["preset"]: r for r in saved["results"]}
    assert set(runs) == set(PRESETS) | {"planned"}, [r.get("error") for r in saved["results"]]
    for name, r in runs.items():
        assert "error" not in r, r.get("error")
        m = r["median"]
        assert m["decode_tps"] > 0 and m["prefill_tps"]["16"] > 0
        assert r["runs"][0]["requests"]["16"]["decode_tokens"] == 7  # the first token comes from prefill
        assert len(r["runs"]) == 2  # one per round, each round in its own worker process
        assert r["peak_rss_bytes"] > 0
        assert 0.0 <= m["hit_rate"] <= 1.0
        layers = r["per_layer"]["decode"]
        assert len(layers) == 8 and all(sum(c) > 0 for c in layers.values())
        if name == "load-on-demand-int4":  # keeps nothing, predicts nothing
            assert r["budget_fraction"] is None and m["hit_rate"] == 0.0 and m["exact_match"] is None
            assert all(c[0] == 0 and c[1] == 0 for c in layers.values())
        else:
            assert r["budget_fraction"] == 0.35
    assert runs["oracle"]["median"]["exact_match"] == 1.0  # it replays the recorded trace of the same request
    md = paths["markdown"].read_text()
    assert "| fate-edge |" in md and "35%" in md


@pytest.mark.slow
def test_ratios_are_against_the_same_run(tiny_run):
    _, result, _ = tiny_run
    runs = {r["preset"]: r for r in result["results"]}
    lod = runs["load-on-demand-int4"]["median"]
    for name in ("fate-edge", "oracle"):
        r = runs[name]
        assert r["ratios"]["load-on-demand-int4"]["decode"] == pytest.approx(
            r["median"]["decode_tps"] / lod["decode_tps"]
        )
        assert r["ratios"]["load-on-demand-int4"]["prefill_16"] == pytest.approx(
            r["median"]["prefill_tps"]["16"] / lod["prefill_tps"]["16"]
        )
        assert r["ratios"]["oracle"]["decode"] == pytest.approx(
            r["median"]["decode_tps"] / runs["oracle"]["median"]["decode_tps"]
        )
    assert "load-on-demand" not in runs["fate-edge"]["ratios"]  # bf16 baseline not run: no made-up ratio


@pytest.mark.slow
def test_every_preset_generates_the_same_tokens(tiny_run):
    _, result, _ = tiny_run
    ref = result["int4_reference_tokens"]
    assert ref is not None and len(ref) == 8
    for r in result["results"]:
        assert r["tokens"] == ref, r["preset"]
        assert r["tokens_match_int4_reference"] is True


def test_quick_drops_what_it_says_and_keeps_explicit_choices():
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    cfg = config_from_args(ap.parse_args(["--quick", "--runs", "2"]))  # an explicit --runs wins
    assert cfg.quick and cfg.links == ["orin-nano-nvme"] and cfg.prompt_tokens == [128]
    assert cfg.decode_tokens == 64 and cfg.runs == 2 and cfg.time_limit_s == 480
    assert cfg.budgets == [0.20, 0.35, 0.50, 0.75] and cfg.presets == ALL_PRESETS
    assert "--quick" in ap.format_help()  # help strings survive argparse's % formatting
    full = config_from_args(ap.parse_args([]))
    assert full.links == list(LINKS) and full.prompt_tokens == [128, 512] and full.decode_tokens == 128


def test_results_markers_are_filled_and_the_rest_kept(tmp_path):
    readme = tmp_path / "docs" / "results" / "bench.md"
    readme.parent.mkdir(parents=True)
    readme.write_text(f"# x\n\nbefore\n{README_BEGIN}\nold\n{README_END}\nafter\n")
    update_readme(readme, "| new | table |")
    text = readme.read_text()
    assert "old" not in text and "| new | table |" in text
    assert text.startswith("# x\n\nbefore\n") and text.endswith(f"{README_END}\nafter\n")
    (tmp_path / "plain.md").write_text("no markers")
    with pytest.raises(SystemExit):
        check_readme(tmp_path / "plain.md")


@pytest.mark.slow
def test_planned_configuration_is_planned_in_its_worker_and_reported(tiny_run):
    cfg, result, paths = tiny_run
    planned = [r for r in result["results"] if r["preset"] == "planned"]
    assert len(planned) == 1 and "error" not in planned[0], planned[0].get("error")
    r = planned[0]
    assert r["planner_predicted_decode_tps"] > 0 and "planner_s" in r
    assert len(r["planner_predictions"]) == 2  # planned again in each round's worker; the median is reported
    assert r["planner_predicted_decode_tps"] == pytest.approx(
        sorted(r["planner_predictions"])[0] / 2 + sorted(r["planner_predictions"])[1] / 2
    )
    # the search's pick, or a preset it weighed and did not beat by more than its error (plan_presets.py)
    assert r["policy"]["name"] in ("planned", "fate-edge", "fate") and "ms compute per layer" in r["planner_costs"]
    assert r["planner_error"] == pytest.approx(r["planner_predicted_decode_tps"] / r["median"]["decode_tps"] - 1)
    # beside the fate-edge row of the same link and budget: its prediction on the planner's trace, its measurement
    preset = next(
        q
        for q in result["results"]
        if q["preset"] == "fate-edge" and q["link"] == r["link"] and q["budget_fraction"] == r["budget_fraction"]
    )
    assert set(r["planner_preset_predictions"]) == {"fate-edge", "fate"}
    assert r["auto_over_preset"] == pytest.approx(r["median"]["decode_tps"] / preset["median"]["decode_tps"])
    assert r["preset_prediction_error"] == pytest.approx(
        r["planner_preset_predictions"]["fate-edge"] / preset["median"]["decode_tps"] - 1
    )
    md = paths["markdown"].read_text()
    assert "**Planner**" in md and f"{r['planner_predicted_decode_tps']:.2f}" in md
    assert "auto / fate-edge" in md and f"{r['auto_over_preset']:.2f}" in md
    # the pick simulated over the measured prompt's own routing with the planner's costs: only without a predictor
    # (the recorded routing has no predictor scores)
    # (each round plans again and may pick otherwise: the median is over the rounds whose pick has none)
    without = any(q["predictor"] is None for q in r["planner_policies"])
    assert ("planner_predicted_on_run_routing" in r) == without
    if without:
        assert r["planner_error_on_run_routing"] == pytest.approx(
            r["planner_predicted_on_run_routing"] / r["median"]["decode_tps"] - 1
        )


@pytest.mark.slow
def test_fate_edge_bench_records_its_own_command_and_runs_its_workers_from_the_install(tmp_path, bundled_dir):
    from fate_edge.format.converted_stores import ensure_store

    store = ensure_store(bundled_dir, cold_bits=2, progress=False, baselines=True)
    argv = [
        "bench",
        "--model",
        str(store),
        "--presets",
        "load-on-demand-int4",
        "--budgets",
        "0.35",
        "--links",
        "orin-nano-nvme",
        "--prompt-tokens",
        "16",
        "--decode-tokens",
        "4",
        "--runs",
        "1",
        "--threads",
        "1",
        "--no-peers",
        "--no-planner",
        "--out-dir",
        str(tmp_path / "out"),
    ]
    # The console script, run outside the checkout without PYTHONPATH: the bench and the worker processes it
    # starts (python -m fate_edge_lab.bench --trace / --worker) import the installed package.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("fate-edge")), *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "out" / "bench.json").read_text())
    want = "fate-edge " + " ".join(argv)
    assert result["command"] == want and result["config"]["command"] == want
    md = (tmp_path / "out" / "bench.md").read_text()
    assert f"`{want}`" in md and "scripts/bench.py" not in md
    (run,) = result["results"]
    assert "error" not in run, run.get("error")
    assert run["median"]["decode_tps"] > 0 and run["tokens"] == result["int4_reference_tokens"]  # both children ran


def test_the_command_is_recorded_as_invoked():
    assert invoked_command(["/venv/bin/fate-edge", "bench", "--quick"]) == "fate-edge bench --quick"
    assert (
        invoked_command(["research/bench_io.py", "--runs", "3", "--results"])
        == "python research/bench_io.py --runs 3 --results"
    )
    assert (
        invoked_command(["/x/fate_edge_lab/bench/__main__.py", "--runs", "1"], "fate_edge_lab.bench")
        == "python -m fate_edge_lab.bench --runs 1"
    )
    assert invoked_command(["fate-edge", "bench", "--work-dir", "my dir"]) == "fate-edge bench --work-dir 'my dir'"


def test_plots_go_next_to_the_json_unless_a_plots_dir_is_given(tmp_path):
    cfg = BenchConfig(
        out_dir=str(tmp_path / "out"), json_path=str(tmp_path / "j" / "b.json"), readme="docs/results/bench.md"
    )
    assert output_paths(cfg) == (tmp_path / "j" / "b.json", tmp_path / "out" / "bench.md", tmp_path / "j" / "bench.png")
    cfg.quick, cfg.plots_dir = True, str(tmp_path / "docs")
    assert output_paths(cfg)[2] == tmp_path / "docs" / "bench_quick.png"
    cfg.plot_path = str(tmp_path / "p.png")  # an explicit plot file wins
    assert output_paths(cfg)[2] == tmp_path / "p.png"
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    assert config_from_args(ap.parse_args(["--plots-dir", "docs"])).plots_dir == "docs"


def test_the_table_goes_to_docs_results_when_asked():
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    assert config_from_args(ap.parse_args([])).readme is None
    assert config_from_args(ap.parse_args(["--results"])).readme == "docs/results/bench.md"
    assert config_from_args(ap.parse_args(["--results", "x.md"])).readme == "x.md"
    check_readme(Path(__file__).resolve().parents[2] / "docs" / "results" / "bench.md")
