"""A first run you can watch: a conversion on first use reports its progress (bytes, rate, time left) and the disk
it needs against the free space, in the log when no terminal watches; the daemon's /health answers 503 with the
stage and progress until the model is ready."""

from __future__ import annotations

import logging
import threading
import time

from fastapi.testclient import TestClient

from fate_edge.format.convert_progress import LoadStatus, ProgressLines


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_progress_lines_say_bytes_rate_and_time_left_every_few_seconds():
    clock, lines, status = Clock(), [], LoadStatus()
    meter = ProgressLines("org/model", lines.append, every=5.0, status=status, clock=clock)
    clock.t += 2
    meter(20_000_000, 100_000_000)
    assert lines == [] and status.stage == "converting" and status.progress == 0.2  # too soon for a line
    clock.t += 3
    meter(50_000_000, 100_000_000)
    assert lines == ["converting org/model: 50% (50.0 MB of 100.0 MB, 10.0 MB/s, about 5 s left)"]
    clock.t += 1
    meter(100_000_000, 100_000_000)  # the end always gets its line
    assert lines[-1] == "converting org/model: 100% (100.0 MB of 100.0 MB, 16.7 MB/s, done)"
    assert status.snapshot() == {"stage": "converting", "progress": 1.0, "detail": lines[-1]}


def test_a_first_use_without_a_terminal_logs_the_disk_it_needs_and_its_progress(model_copy, caplog):
    from fate_edge.format.converted_stores import ensure_store
    from fate_edge.format.store import is_store

    status = LoadStatus()
    with caplog.at_level(logging.INFO, logger="fate_edge.convert"):
        store = ensure_store(model_copy, progress=False, status=status)
    assert is_store(store)
    text = caplog.text
    assert f"first use of {model_copy}" in text and "needs about" in text and "free there" in text
    assert f"converting {model_copy}: 100%" in text
    assert status.stage == "converting" and status.progress == 1.0


def test_health_reports_the_loading_stage_and_progress(monkeypatch):
    import fate_edge.apps.engine_args as engine_args
    from fate_edge.apps.engine_args import EngineOptions
    from fate_edge.apps.server import ServerSettings, create_app

    release, real_open = threading.Event(), engine_args.open_engine

    def converting_open(*a, status=None, **kw):
        status.set("converting", 0.25, "converting tiny: 25%")
        release.wait(30)
        return real_open(*a, status=status, **kw)

    monkeypatch.setattr(engine_args, "open_engine", converting_open)
    app = create_app(ServerSettings(engine=EngineOptions(memory_budget="2MB", device="cpu", threads=1)))
    with TestClient(app, base_url="http://localhost") as tc:
        deadline = time.monotonic() + 10
        while tc.get("/health").json().get("stage") != "converting" and time.monotonic() < deadline:
            time.sleep(0.02)
        r = tc.get("/health")
        body = r.json()
        assert r.status_code == 503 and body["status"] == "loading", body
        assert body["stage"] == "converting" and body["progress"] == 0.25 and body["detail"] == "converting tiny: 25%"
        release.set()
        deadline = time.monotonic() + 60
        while tc.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tc.get("/health").json() == {"status": "ok"}
