"""The daemon as a real process under uvicorn: a non-streaming client hanging up, requests uvicorn rejects itself,
the Host guard over TCP, and the Unix socket's permissions, takeover refusal and cleanup."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time

import pytest
from test_server import BUDGET, COMP, ROOT, Server, _env

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]  # each test starts a daemon or shares one


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("fe-daemon")


@pytest.fixture(scope="module")
def server(default_server):
    return default_server  # shared with the other module that needs only a default daemon (tests/conftest.py)


def _raw_request(port: int, head: bytes, body: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(head + b"\r\n\r\n" + body)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _wait_for(condition, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_a_non_streaming_request_stops_when_its_client_hangs_up(server):
    cancelled = server.metric("fate_edge_requests_cancelled_total")
    tokens = server.metric("fate_edge_generation_tokens_total")
    body = b'{"prompt": "def f():", "max_tokens": 1000, "ignore_eos": true, "temperature": 0}'
    sock = _raw_request(
        server.port,
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d" % len(body),
        body,
    )
    try:
        assert _wait_for(lambda: server.metric("fate_edge_requests_running") == 1)
    finally:
        sock.close()  # the client hangs up before the answer
    assert _wait_for(lambda: server.metric("fate_edge_requests_cancelled_total") == cancelled + 1)
    assert server.metric("fate_edge_requests_running") == 0
    assert server.metric("fate_edge_generation_tokens_total") - tokens < 500  # stopped, far short of 1000
    r = server.http.post(COMP, json={"prompt": "x = ", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("length", [b"abc", b"12abc", b"-1", b"+5", b"0x10"])
def test_a_malformed_content_length_gets_an_openai_shaped_400(server, length):
    sock = _raw_request(
        server.port,
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: " + length,
        b'{"prompt":"x"}',
    )
    with sock:
        head, _, body = _read_all(sock).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), head
    assert b"content-type: application/json" in head.lower()
    err = json.loads(body)["error"]
    assert err["type"] == "invalid_request_error" and "malformed HTTP request" in err["message"]
    assert server.raw.get("/health").status_code == 200


def test_dns_rebinding_host_is_refused_over_tcp(server):
    resp = server.raw.post(COMP, json={"prompt": "x", "max_tokens": 2}, headers={"Host": "rebind.example:8080"})
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "host_not_allowed"
    resp = server.raw.post(COMP, json={"prompt": "x", "max_tokens": 2}, headers={"Origin": "https://evil.example"})
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "origin_not_allowed"
    resp = server.raw.post(COMP, content=b'{"prompt": "x", "max_tokens": 2}', headers={"Content-Type": "text/plain"})
    assert resp.status_code == 415


def _serve(cache, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "fate_edge",
        "serve",
        "--threads",
        "1",
        "--memory-budget",
        BUDGET,
        "--log-level",
        "warning",
        *args,
    ]
    return subprocess.run(cmd, env=_env(cache), capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_unix_socket_is_private_never_taken_over_and_removed_only_by_its_owner(cache):
    path = str(cache / "d.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)  # a socket file nobody listens on, as a crashed daemon leaves behind
    stale.close()
    s = Server(cache, "--socket-mode", "660", uds=path)
    try:
        assert "removed the stale socket" in s.output()
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
        # A second daemon on the same path refuses to start, and the first keeps its socket.
        second = _serve(cache, "--unix-socket", path)
        assert second.returncode == 2 and "another server is listening" in second.stderr, second.stderr
        assert "Traceback" not in second.stderr
        assert s.raw.get("/health").status_code == 200
        # Someone else now owns the path: the daemon must not delete their socket when it exits.
        os.unlink(path)
        other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        other.bind(path)
        other.listen()
        ino = os.stat(path).st_ino
        s.proc.terminate()
        assert s.proc.wait(timeout=30) == 0
        assert os.path.exists(path) and os.stat(path).st_ino == ino
        assert "is no longer the socket this server created" in s.output()
        other.close()
    finally:
        s.stop()


def test_socket_mode_must_be_octal(cache):
    bad = _serve(cache, "--unix-socket", str(cache / "m.sock"), "--socket-mode", "rw-------", timeout=60)
    assert bad.returncode == 2 and "--socket-mode must be octal" in bad.stderr, bad.stderr
