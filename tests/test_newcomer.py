"""The first hour of a new user, with no flag but the model's name: a GGUF made here (the gguf package, from the
bundled model's weights) in a fake Ollama store and in a Hugging Face cache laid out as huggingface_hub lays it
out; ``list``, ``run --model NAME`` and ``serve --model NAME`` answered by the openai client. HOME, OLLAMA_MODELS,
HF_HUB_CACHE and FATE_EDGE_CACHE point at temporary folders: nothing real is read or written.

``run`` gets ``--max-tokens 8`` (without it the tiny model writes until its 1024-token context is full, ~40 s
here) and ``serve`` a free ``--port``; nothing else."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
from _gguf_writer import write_gguf
from _local_caches import hf_add, ollama_add

from fate_edge import bundled_model_dir
from fate_edge.format.store import is_store

PROMPT = "def fibonacci(n):"
OLLAMA_NAME, HF_NAME = "tiny:q4", "fate/tiny-moe-GGUF"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> dict[str, str]:
    """The environment of a user whose caches hold the model, and fate-edge's cache empty."""
    root = tmp_path_factory.mktemp("newcomer")
    gguf = write_gguf(bundled_model_dir(), root / "tiny-moe-Q4_0.gguf", "Q4_0", "F32")
    ollama_add(root / "ollama", "tiny", "q4", gguf)
    hf_add(root / "hub", HF_NAME, {"tiny-moe-Q4_0.gguf": gguf})
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "XDG_CACHE_HOME")}
    env.update(
        HOME=str(root / "home"),
        OLLAMA_MODELS=str(root / "ollama"),
        HF_HUB_CACHE=str(root / "hub"),
        FATE_EDGE_CACHE=str(root / "fate-edge"),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    (root / "home").mkdir()
    return env


def fate_edge(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fate_edge", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def stores(env: dict[str, str]) -> list[Path]:
    root = Path(env["FATE_EDGE_CACHE"]) / "stores"
    return [p for p in root.iterdir() if is_store(p)] if root.is_dir() else []


def test_huggingface_hub_sees_the_cache_as_laid_out(home):
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(home["HF_HUB_CACHE"])
    assert [r.repo_id for r in info.repos] == [HF_NAME] and not info.warnings


def test_list_run_and_list_again(home):
    listed = fate_edge(home, "list")
    assert listed.returncode == 0, listed.stderr
    rows = {line.split()[0]: line for line in listed.stdout.splitlines()[1:] if line.strip()}
    for name, source in ((OLLAMA_NAME, "ollama"), (HF_NAME, "huggingface")):
        assert source in rows[name] and "qwen2moe" in rows[name] and "13.1M" in rows[name], listed.stdout
        assert rows[name].rstrip().endswith("no"), rows[name]  # not converted yet

    by_ollama = fate_edge(home, "run", "--model", OLLAMA_NAME, "--max-tokens", "8", PROMPT)
    assert by_ollama.returncode == 0, by_ollama.stderr
    assert by_ollama.stdout.strip()
    # the first use converts, and says so: what, the disk it needs against the free space, and its progress
    err = by_ollama.stderr
    assert f"first use of {OLLAMA_NAME}" in err and "of disk" in err and "free there" in err, err
    assert f"converting {OLLAMA_NAME}: 100%" in err and "/s" in err, err

    by_hf = fate_edge(home, "run", "--model", HF_NAME, "--max-tokens", "8", PROMPT)
    assert by_hf.returncode == 0, by_hf.stderr
    assert by_hf.stdout == by_ollama.stdout  # the same GGUF bytes: the same greedy text

    again = fate_edge(home, "list")
    rows = {line.split()[0]: line for line in again.stdout.splitlines()[1:] if line.strip()}
    assert "yes, store" in rows[OLLAMA_NAME] and "yes, store" in rows[HF_NAME], again.stdout
    missing = fate_edge(home, "run", "--model", "nobody:nothing", PROMPT)
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
    assert home["OLLAMA_MODELS"] in missing.stderr and "/usr/share/ollama/.ollama/models" in missing.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_by_name_answers_the_openai_client(home, tmp_path):
    port = _free_port()
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "fate_edge", "serve", "--model", OLLAMA_NAME, "--port", str(port)],
        env=home,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.seek(0) or log.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [OLLAMA_NAME]
        done = client.completions.create(model=OLLAMA_NAME, prompt=PROMPT, max_tokens=8, temperature=0)
        assert done.choices[0].text and done.usage.completion_tokens <= 8
        chat = client.chat.completions.create(
            model=OLLAMA_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert chat.choices[0].message.content is not None
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        log.close()


INTERRUPTIBLE_FATE_EDGE = (
    "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "runpy.run_module('fate_edge', run_name='__main__', alter_sys=True)"
)


def freeze_once(proc: subprocess.Popen, reached: Callable[[], bool], timeout: float = 10) -> None:
    """Leave ``proc`` stopped (SIGSTOP) at the first point where ``reached()`` holds. It runs in slices of a
    millisecond between checks, so the tiny model's conversion (a fraction of a second) cannot finish between the
    check and the signal the caller sends next, however loaded the host is."""
    deadline = time.monotonic() + timeout
    while True:
        proc.send_signal(signal.SIGSTOP)
        while Path(f"/proc/{proc.pid}/stat").read_text().rpartition(")")[2].split()[0] not in "Tt":
            time.sleep(0.0005)  # SIGSTOP is delivered asynchronously
        if reached() or time.monotonic() > deadline:
            return
        proc.send_signal(signal.SIGCONT)
        time.sleep(0.001)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_a_first_use_stopped_mid_conversion_leaves_no_store_and_the_next_use_converts(home, tmp_path, sig):
    env = dict(home, FATE_EDGE_CACHE=str(tmp_path / "cache"))
    # --memory-budget: the engine's path, where the conversion runs on a loading thread of its own
    cmd = [sys.executable, "-m", "fate_edge", "run", "--model", OLLAMA_NAME, "--memory-budget", "8MB"]
    # Ctrl-C's handler put back first: a test run started in the background (`cmd &`) hands its children SIGINT ignored
    interruptible = [sys.executable, "-c", INTERRUPTIBLE_FATE_EDGE, *cmd[3:]]
    proc = subprocess.Popen([*interruptible, "--max-tokens", "4", PROMPT], env=env, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        if line.startswith("[convert] writing"):  # the working folder is made next: stop once it is marked
            freeze_once(
                proc, lambda: any((Path(env["FATE_EDGE_CACHE"]) / "stores").glob(".*.partial-*/.fate-edge-work"))
            )
            proc.send_signal(sig)  # lands mid-conversion: the process is frozen there
            proc.send_signal(signal.SIGCONT)
            break
    status = proc.wait(timeout=60)
    assert status == (130 if sig == signal.SIGINT else -signal.SIGKILL), f"exit status {status}"
    assert stores(env) == []
    again = subprocess.run([*cmd, "--max-tokens", "4", PROMPT], env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert len(stores(env)) == 1
    left = [p.name for p in (Path(env["FATE_EDGE_CACHE"]) / "stores").iterdir() if p.name.startswith(".")]
    assert left == [], left  # the dead run's working folder was removed
