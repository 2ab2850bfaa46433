"""scripts/bench_scale.py's library on the bundled model: convert in a capped child, runs in cgroups sized by
memory_need, and the table. (Cgroups need root; without them the children run uncapped and say so.)"""

import importlib.util
from pathlib import Path

from fate_edge.bench.scale import ScaleConfig, run_scale
from fate_edge.checkpoint import CheckpointReader
from fate_edge.convert import ConvertOptions
from fate_edge.footprint import memory_need
from fate_edge.store import ExpertStore


def _script():
    path = Path(__file__).parent.parent / "scripts" / "bench_scale.py"
    spec = importlib.util.spec_from_file_location("bench_scale", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_scale_bench_converts_and_runs_each_budget_within_its_cap(tmp_path, bundled_dir):
    budgets = [1_500_000, 3_000_000]
    cfg = ScaleConfig(bundled_dir, tmp_path / "store", budgets, convert_limit=1_000_000_000,
                      convert_opts=ConvertOptions(bits=4, cold_bits=2, keep_bf16=False), prompt_tokens=12,
                      decode_tokens=3, threads=1, drop_caches=False, disk_probe_bytes=32 << 20, timeout_s=600)
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

    text = _script().table(result)
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and "GB |" in ln]
    assert len(rows) == len(budgets) and "int4 + int2 experts, rtn" in text
