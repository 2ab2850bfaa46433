"""The bench's throughput mode: both modes serve the same requests, and the table reads the JSON it writes."""

import json

import pytest
import torch

from fate_edge_lab.bench.throughput import run
from fate_edge_lab.bench.throughput_report import publish_table, table_row
from fate_edge_lab.bench.throughput_rounds import ThroughputConfig, bytes_ratio, percentile, ratio_text


def test_bytes_ratio_is_none_where_the_batch_read_nothing_and_the_table_says_so():
    assert bytes_ratio(138.0, 69.0) == 2.0 and bytes_ratio(5.0, 0.0) is None and bytes_ratio(0.0, 0.0) is None
    assert ratio_text(1.414) == "1.41x" and ratio_text(None) == "-"
    mode = {"tok_s": 1.0, "token_p50_s": 0.01, "token_p90_s": 0.01, "token_p99_s": 0.01, "ttft_p50_s": 0.1}
    run = {
        "alone": mode | {"bytes_per_token": 0.0},
        "batched": mode | {"bytes_per_token": 0.0},
        "single_request": mode,
        "ratios": {
            "tok_s_batched_over_alone": 1.0,
            "token_p50_batched_over_single": 1.0,
            "bytes_per_token_alone_over_batched": None,
        },
        "config": {"dtype": "float32", "concurrency": 8, "budget_fraction": 1.0},
        "host": {"cpu": "x", "torch_threads": 1, "load_average": [0.5, 0.5, 0.5]},
        "mean_batch": 8.0,
    }
    cells = [c.strip() for c in table_row("every-expert-cached", run).split("|")]
    assert cells[13] == "**-**" and cells[12] == "0 / 0"  # the bytes ratio column, after the KB read per token


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
    import fate_edge_lab.bench.publish as publish

    old = publish.RESULTS_DIR
    publish.RESULTS_DIR = tmp_path
    try:
        text = publish_table(tmp_path)
    finally:
        publish.RESULTS_DIR = old
    assert text.count("\n| tiny |") == 1 and "load avg" in text
    assert "batching:begin" in (tmp_path / "batching.md").read_text()


@pytest.mark.usefixtures("one_thread")
def test_emulated_throughput_dilates_each_mode_by_its_own_step(tmp_path):
    """``--emulate``: each mode's k is its host step over its roofline step (a batched step reads the resident
    weights once and its measured union of experts), its link is the device's dilated by that k, and its figures
    are the raw ones x k (latencies / k). The emulated table reads the JSON; the host table leaves it out."""
    from fate_edge.devices.emulate import device_roofline
    from fate_edge.devices.profile import load_profile

    from fate_edge_lab.bench.throughput_emulated import run_emulated
    from fate_edge_lab.bench.throughput_report import publish_emulated_table

    before = torch.get_num_threads()
    try:
        out = run_emulated(ThroughputConfig(concurrency=3, max_tokens=4, rounds=1, threads=1, emulate="orin-nano"))
    finally:
        torch.set_num_threads(before)
    em = out["emulation"]
    roof = device_roofline(load_profile(em["profile"]))
    link = em["device_link"]
    alone, batched = em["alone"], em["batched"]
    assert alone["rows"] == 1 and alone["union_per_layer"] == 2  # the bundled model routes top-2
    assert 2 < batched["union_per_layer"] <= 6 and batched["rows"] == 3  # 3 rows: more experts, at most 3 x 2
    assert batched["device_bytes"] > alone["device_bytes"] and batched["device_flops"] == 3 * alone["device_flops"]
    for mode, name in ((alone, "alone"), (batched, "batched")):
        assert mode["device_step_s"] == pytest.approx(roof.time_s(mode["device_bytes"], mode["device_flops"]))
        assert mode["k"] == pytest.approx(mode["host_step_s"] / mode["device_step_s"])
        dilated = em[f"emulated_link_{name}"]
        assert dilated["bandwidth_bytes_per_s"] == pytest.approx(link["bandwidth_bytes_per_s"] / mode["k"])
        raw, dev = out["raw"][name], out[name]
        assert dev["tok_s"] == pytest.approx(raw["tok_s"] * mode["k"])
        assert dev["token_p50_s"] == pytest.approx(raw["token_p50_s"] / mode["k"])
        assert dev["bytes_per_token"] == raw["bytes_per_token"] and dev["tokens"] == 3 * 4
    assert out["ratios"]["tok_s_batched_over_alone"] == pytest.approx(out["batched"]["tok_s"] / out["alone"]["tok_s"])
    (tmp_path / "batching-emulated-tiny.json").write_text(json.dumps(out))
    import fate_edge_lab.bench.publish as publish

    old = publish.RESULTS_DIR
    publish.RESULTS_DIR = tmp_path
    try:
        text = publish_emulated_table(tmp_path)
        host_table = publish_table(tmp_path)
    finally:
        publish.RESULTS_DIR = old
    assert text.count("\n| tiny | jetson-orin-nano-8gb | 3 |") == 1 and "Device-equivalent" in text
    assert "emulated-tiny" not in host_table


def test_run_round_serves_in_waves_of_at_once():
    """``at_once``: every prompt served, never more than that many at a time (a fake engine counts them)."""
    import threading

    from fate_edge.runtime.scheduler import SchedulerStats
    from fate_edge_lab.bench.throughput_rounds import run_round

    class Counting:
        stats = SchedulerStats()

        def __init__(self, wave: int, total: int):
            self.cv, self.wave, self.total = threading.Condition(), wave, total
            self.active = self.started = self.most = 0
            self.served: list[str] = []

        def stream(self, prompt, config):
            with self.cv:
                self.active += 1
                self.started += 1
                self.most = max(self.most, self.active)
                self.cv.notify_all()
                # held until the rest of its wave has started (arrivals only grow: no wake-up is lost), so a thread
                # slow to start cannot hide requests that run together; then a moment more for a request of a later
                # wave, which a run_round that started it too early would let in while this one still runs
                wave_end = min(self.total, -(-self.started // self.wave) * self.wave)
                self.cv.wait_for(lambda: self.started >= wave_end, timeout=10)
                self.cv.wait_for(lambda: self.started > wave_end, timeout=0.2 if wave_end < self.total else 0)
            try:
                for _ in range(config.max_tokens):
                    yield prompt
            finally:
                with self.cv:
                    self.active -= 1
                    self.served.append(prompt)

    for at_once, most in ((2, 2), (0, 5), (1, 1)):
        engine = Counting(at_once or 5, 5)
        out = run_round(engine, [f"p{i}" for i in range(5)], 3, True, at_once=at_once)
        assert out["tokens"] == 15 and sorted(engine.served) == [f"p{i}" for i in range(5)]
        assert engine.most == most


@pytest.mark.usefixtures("one_thread")
def test_sweep_predicts_beside_measuring_the_same_requests_at_each_batch():
    from fate_edge_lab.bench.throughput import sweep
    from fate_edge_lab.bench.throughput_report import sweep_table

    before = torch.get_num_threads()
    try:
        out = sweep(ThroughputConfig(max_tokens=6, rounds=1, threads=1), batches=(1, 2))
    finally:
        torch.set_num_threads(before)
    assert [r["batch"] for r in out["rows"]] == [1, 2] and out["chosen_batch"] in (1, 2)
    for r in out["rows"]:
        assert r["predicted_step_s"] > 0 and r["measured_step_p50_s"] > 0
        assert r["measured_decode_tok_s"] == pytest.approx(r["batch"] / r["measured_step_p50_s"])
    costs = out["costs"]
    assert costs["read_s"] >= 0 and costs["step_s"] > 0 and costs["reads_per_step"] >= 0
    row = sweep_table({"tiny": out}).splitlines()[2]
    assert row.startswith("| tiny | 1 |") and row.rstrip().endswith("torch thread |")  # the CPU and its threads
