"""The daemon against slow, vanishing and greedy clients: header and body timeouts, a cap on open connections,
a client hanging up mid-upload (no traceback, no 500), and a request too large for the KV room answered 400."""

from __future__ import annotations

import re
import socket
import time

import pytest
from fastapi.testclient import TestClient
from test_server import BUDGET, COMP, Server

HEADER_TIMEOUT = 1.5


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(
        tmp_path_factory.mktemp("fe-hard"),
        "--header-timeout",
        str(HEADER_TIMEOUT),
        "--body-timeout",
        "2",
        "--max-connections",
        "4",
    )
    yield s
    s.stop()


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30)


def _closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> float | None:
    """Seconds until the server closes ``sock`` (None if it is still open after ``seconds``), sending one byte
    of ``trickle`` every 0.3 s meanwhile (a slowloris)."""
    start = time.monotonic()
    sock.settimeout(0.3)
    i = 0
    while time.monotonic() - start < seconds:
        try:
            if sock.recv(4096) == b"":
                return time.monotonic() - start
        except TimeoutError:
            pass
        except ConnectionResetError:
            return time.monotonic() - start
        if i < len(trickle):
            try:
                sock.sendall(trickle[i : i + 1])
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - start
            i += 1
    return None


@pytest.mark.slow
def test_a_connection_trickling_its_headers_is_closed(server):
    sock = _connect(server.port)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200
    took = _closed_within(sock, 10, trickle=head)
    assert took is not None and took < HEADER_TIMEOUT + 2, took


@pytest.mark.slow
def test_a_connection_that_sends_nothing_is_closed(server):
    took = _closed_within(_connect(server.port), 10)
    assert took is not None and took < HEADER_TIMEOUT + 2, took


@pytest.mark.slow
def test_a_kept_alive_connection_serves_a_second_request_within_the_timeout(server):
    for _ in range(2):  # the timer restarts with each request's first byte, then stops at its headers
        assert server.http.get("/health").status_code == 200
        time.sleep(HEADER_TIMEOUT * 0.7)
    assert server.http.post(COMP, json={"prompt": "x = ", "max_tokens": 2}).status_code == 200


@pytest.mark.slow
def test_open_connections_past_the_cap_get_503_and_the_daemon_recovers(server):
    idle = [_connect(server.port) for _ in range(4)]
    time.sleep(0.2)
    sock = _connect(server.port)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert sock.recv(4096).startswith(b"HTTP/1.1 503")
    for s in [*idle, sock]:
        s.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and server.http.get("/health").status_code != 200:
        time.sleep(0.2)
    assert server.http.get("/health").status_code == 200


@pytest.mark.slow
def test_a_client_hanging_up_mid_upload_is_no_500_and_no_traceback(server):
    count = lambda status: server.metric(  # noqa: E731
        "fate_edge_requests_total", f'{{endpoint="/v1/completions",status="{status}"}}'
    )
    errors_before, hangups_before = count(500), count(499)
    sock = _connect(server.port)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n" + b'{"prompt": "'
    )
    time.sleep(0.3)
    sock.close()
    time.sleep(0.5)
    assert server.http.post(COMP, json={"prompt": "x = ", "max_tokens": 2}).status_code == 200  # still serving
    assert count(500) == errors_before and count(499) == hangups_before + 1  # counted as the client's doing
    assert "Traceback" not in server.output() and "ClientDisconnect" not in server.output()


@pytest.mark.slow
def test_a_body_that_never_finishes_gets_408(server):
    sock = _connect(server.port)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n" + b'{"prompt": "'
    )
    sock.settimeout(10)
    answer = b""
    while b"request_timeout" not in answer and (chunk := sock.recv(65536)):
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer, answer[:300]


def test_a_request_past_the_kv_room_is_a_400_not_a_500():
    from fate_edge import Engine
    from fate_edge.apps.engine_args import EngineOptions
    from fate_edge.apps.server import ServerSettings, create_app

    with Engine.load(memory_budget=BUDGET, device="cpu", context_tokens=64) as engine:
        app = create_app(ServerSettings(engine=EngineOptions(memory_budget=BUDGET, device="cpu")), engine=engine)
        with TestClient(app, base_url="http://127.0.0.1:8080") as tc:
            resp = tc.post(COMP, json={"prompt": "x = 1\n" * 20, "max_tokens": 500})  # fits the 1024 context
            assert resp.status_code == 400, resp.text
            err = resp.json()["error"]
            assert err["code"] == "kv_room_exceeded" and re.search(r"needs .* of KV cache", err["message"])
            assert tc.post(COMP, json={"prompt": "x = ", "max_tokens": 2}).status_code == 200
