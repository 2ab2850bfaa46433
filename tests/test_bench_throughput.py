"""The bench's throughput mode: both modes serve the same requests, and the table reads the JSON it writes."""

import json

import pytest
import torch

from fate_edge.bench.throughput import ThroughputConfig, percentile, run
from fate_edge.bench.throughput_report import publish_table


def test_percentile_picks_ranks():
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and percentile([1.0], 0.99) == 1.0
    assert percentile([], 0.5) != percentile([], 0.5)  # NaN for no samples


@pytest.mark.usefixtures("one_thread")
def test_throughput_run_serves_the_same_requests_both_ways(tmp_path):
    before = torch.get_num_threads()
    try:
        out = run(ThroughputConfig(concurrency=3, max_tokens=4, rounds=1, threads=1))
    finally:
        torch.set_num_threads(before)
    for mode in ("alone", "batched"):
        r = out[mode]
        assert r["tokens"] == 3 * 4 and r["tok_s"] > 0 and r["bytes_per_token"] >= 0
        assert r["ttft_p50_s"] <= r["ttft_p90_s"] and r["token_p50_s"] <= r["token_p99_s"]
    assert out["single_request"]["tokens"] == 4 and 1 <= out["mean_batch"] <= 3
    assert set(out["ratios"]) == {
        "tok_s_batched_over_alone",
        "token_p50_batched_over_single",
        "bytes_per_token_alone_over_batched",
    }
    assert out["host"]["cores"] >= 1 and len(out["host"]["load_average"]) == 3
    (tmp_path / "batching-tiny.json").write_text(json.dumps(out))
    (tmp_path / "batching-agreement.json").write_text(json.dumps({"cases": []}))  # not a throughput run: skipped
    import fate_edge.bench.publish as publish

    old = publish.RESULTS_DIR
    publish.RESULTS_DIR = tmp_path
    try:
        text = publish_table(tmp_path)
    finally:
        publish.RESULTS_DIR = old
    assert text.count("\n| tiny |") == 1 and "load avg" in text
    assert "batching:begin" in (tmp_path / "batching.md").read_text()
