"""fate-edge bench-scale's library on the bundled model: convert in a capped child, runs in cgroups sized by
memory_need, and the table. (Cgroups need root; without them the children run uncapped and say so.)"""

import argparse

import pytest

from fate_edge.format.checkpoint import CheckpointReader
from fate_edge.format.convert import ConvertOptions
from fate_edge.format.store import ExpertStore
from fate_edge.runtime.footprint import memory_need
from fate_edge_lab.bench.scale import GB, ScaleConfig, run_scale
from fate_edge_lab.bench.scale_cli import build_parser, gb_list, side_by_side, table


@pytest.mark.slow
def test_scale_bench_converts_and_runs_each_budget_within_its_cap(tmp_path, bundled_dir):
    budgets = [1_500_000, 3_000_000]
    cfg = ScaleConfig(
        bundled_dir,
        tmp_path / "store",
        budgets,
        convert_limit=1_000_000_000,
        convert_opts=ConvertOptions.full(bits=4, cold_bits=2, keep_bf16=False),
        prompt_tokens=12,
        decode_tokens=3,
        threads=1,
        drop_caches=False,
        disk_probe_bytes=32 << 20,
        timeout_s=600,
    )
    result = run_scale(cfg, tmp_path / "out")

    reader = CheckpointReader(bundled_dir)
    conv = result["convert"]
    assert "error" not in conv, conv
    assert conv["source_bytes"] == sum(reader.nbytes(n) for n in reader.keys())
    assert [d for _, d in conv["progress"]] == sorted(d for _, d in conv["progress"])
    assert sorted(ExpertStore(cfg.store).bits_available) == [2, 4]
    assert conv["peak_rss_bytes"] > 0 and conv.get("oom_kills", 0) == 0

    assert [r["budget_bytes"] for r in result["runs"]] == budgets
    for r in result["runs"]:
        assert "error" not in r, r
        need = memory_need(cfg.store, r["budget_bytes"], cfg.dtype, cfg.prompt_tokens + cfg.decode_tokens)
        assert r["limit_bytes"] == need.total and r["resident_bytes"] == need.resident_bytes
        assert (r["prompt_tokens"], r["decode_tokens"]) == (12, 3)
        assert r["within_need"] and r["peak_rss_bytes"] <= need.total
        assert r.get("oom_kills", 0) == 0
        uses = r["decode"]["uses"]
        assert uses > 0 and 0 <= r["decode_hit_rate"] <= 1
        read = r["decode"]["demand_bytes"] + r["decode"]["prefetch_bytes"]
        assert abs(r["decode_mb_read_per_token"] - read / 3 / 1e6) < 1e-9

    text = table(result)
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and "GB |" in ln]
    assert len(rows) == len(budgets) and "int4 + int2 experts, rtn" in text


def _fake_llama(decode_tps: float):
    """A stand-in for sidebyside.child_command's llama.cpp child: prints one JSON line as child_main does,
    echoing how many prompt ids and threads it was given."""
    import json
    import sys

    code = (
        "import json, sys; s = json.loads(open(sys.argv[1]).read()); print(json.dumps({'prefill_tps': 50.0, "
        "'decode_tps': "
        f"{decode_tps}, 'tokens': [1, 2, 3], 'decode_read_mb_per_token': 7.5, 'peak_rss_bytes': 123456789, "
        "'n_ids': len(s['ids']), 'threads': s['threads'], 'mode': s['mode'], 'repack': s['repack']}))"
    )

    def command(spec, folder):
        path = folder / "spec.json"
        path.write_text(json.dumps(spec))
        return [sys.executable, "-c", code, str(path)]

    return command


@pytest.mark.slow
def test_llama_side_runs_beside_each_budget_in_every_round_under_the_same_cap(tmp_path, bundled_dir, monkeypatch):
    from fate_edge_lab.bench import sidebyside

    monkeypatch.setattr(sidebyside, "child_command", _fake_llama(0.5))
    store = tmp_path / "store"
    from fate_edge.format.convert import convert

    convert(bundled_dir, store, ConvertOptions.full(bits=4, keep_bf16=False), progress=False)
    budgets = [1_500_000, 3_000_000]
    cfg = ScaleConfig(
        bundled_dir,
        store,
        budgets,
        convert=False,
        prompt_tokens=12,
        decode_tokens=3,
        threads=1,
        drop_caches=False,
        timeout_s=600,
        resident_bits=4,
        gguf=tmp_path / "fake.gguf",
        rounds=2,
    )
    result = run_scale(cfg, tmp_path / "out")

    assert [(r["round"], r["budget_bytes"]) for r in result["runs"]] == [(0, b) for b in budgets] + [
        (1, b) for b in budgets
    ]
    assert [(r["round"], r["budget_bytes"]) for r in result["llama"]] == [
        (r["round"], r["budget_bytes"]) for r in result["runs"]
    ]  # interleaved: one llama.cpp run after each
    for ours, theirs in zip(result["runs"], result["llama"]):
        assert "error" not in ours and "error" not in theirs, (ours, theirs)
        need = memory_need(store, ours["budget_bytes"], cfg.dtype, 15, resident_bits=4)
        assert ours["resident_bytes"] == need.resident_bytes  # int4 resident weights, as memory_need counts them
        assert ours["limit_bytes"] == theirs["limit_bytes"] == need.total  # the same cap on both sides
        assert theirs["n_ids"] == ours["prompt_tokens"] == 12 and theirs["threads"] == 1
        assert theirs["mode"] == "limited" and ours["decode_read_mb_per_token"] is not None
        assert theirs["repack"] is False  # llama.cpp's weights stay mapped (its repack would copy them into RAM)
    summary = result["summary"]
    assert [row["budget_bytes"] for row in summary] == budgets
    for row in summary:
        fe, ll = row["sides"]["fate-edge"], row["sides"]["llama.cpp"]
        assert (fe["runs"], ll["runs"], fe["failed"], ll["failed"]) == (2, 2, 0, 0)
        assert ll["decode_tps"] == 0.5 and ll["decode_read_mb_per_token"] == 7.5
        assert abs(fe["decode_tps_ratio"] - fe["decode_tps"] / 0.5) < 1e-9

    text = table(result)
    assert text.count("| fate-edge |") == text.count("| llama.cpp |") == len(budgets)
    assert "2 interleaved round(s)" in text and "int4 resident weights" in text
    assert result["cpu_model"] and f"({result['cpu_model']})" in text
    assert text.count("fate-edge decode time per token at") == len(budgets) and "stall on reads" in text


def test_side_by_side_table_from_a_result_with_failures_and_ooms():
    from fate_edge_lab.bench.scale import summarize_scale

    def run(budget, decode, **extra):
        return {
            "budget_bytes": budget,
            "limit_bytes": budget + 10**9,
            "prefill_tps": 10.0,
            "decode_tps": decode,
            "peak_rss_bytes": 5 * 10**8,
            "decode_read_mb_per_token": 1.0,
            "load_before": [1.0],
            **extra,
        }

    g2, g4 = 2 * 10**9, 4 * 10**9
    runs = [run(g2, 3.0, peak_bytes=2 * 10**9), run(g4, 4.0), run(g2, 5.0), run(g4, 6.0)]
    llama = [
        run(g2, 1.0, peak_bytes=3 * 10**9, oom_kills=1),
        {"budget_bytes": g2, "limit_bytes": g2 + 10**9, "error": "killed", "oom_kills": 2, "load_before": [1.5]},
        run(g4, 4.0),
        run(g4, 2.0),
    ]
    summary = summarize_scale(runs, llama)
    two = summary[0]["sides"]
    assert two["fate-edge"]["decode_tps"] == 4.0 and two["llama.cpp"]["decode_tps"] == 1.0
    assert two["fate-edge"]["decode_tps_ratio"] == 4.0
    assert (two["llama.cpp"]["runs"], two["llama.cpp"]["failed"], two["llama.cpp"]["oom_kills"]) == (2, 1, 3)
    assert two["llama.cpp"]["cgroup_peak_bytes"] == 3 * 10**9
    assert summary[1]["sides"]["fate-edge"]["decode_tps_ratio"] == 5.0 / 3.0
    result = {
        "config": {
            "threads": 1,
            "prompt_tokens": 64,
            "decode_tokens": 16,
            "rounds": 2,
            "resident_bits": 4,
            "dtype": "bfloat16",
        },
        "summary": summary,
    }
    text = "\n".join(side_by_side(result))
    assert "2 GB: 4.00x (met); 4 GB: 1.67x (missed)" in text
    assert "| 2 GB | 3.00 GB | llama.cpp |" in text and "| 2 (1) |" in text


def test_budgets_are_gb_lists_and_empty_means_convert_only(tmp_path):
    assert gb_list("2,4") == [int(2 * GB), int(4 * GB)] and gb_list("0.5") == [int(0.5 * GB)]
    assert gb_list("") == []  # convert only
    for bad in ("abc", "0", "-1", "2,x", "inf"):
        with pytest.raises(argparse.ArgumentTypeError, match="budgets in GB"):
            gb_list(bad)
    assert build_parser().parse_args([str(tmp_path), "s"]).budgets == [int(2 * GB), int(4 * GB)]  # default "2,4"


def test_a_side_reads_a_long_prompt_from_its_spec_file(tmp_path):
    # A 4,096-token prompt's ids and text once overflowed the argument list ("Argument list too long").
    import json

    from fate_edge_lab.bench import sidebyside

    spec = {"kind": "fate-edge", "ids": list(range(200_000)), "text": "x" * 2_000_000}
    cmd = sidebyside.child_command(spec, tmp_path)
    assert sum(len(a) for a in cmd) < 4096
    assert json.loads(open(cmd[-1]).read()) == spec
