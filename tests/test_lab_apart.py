"""The product never loads the lab: serving a request (the SDK and the daemon's app) imports no ``fate_edge_lab``
module, and a lab command without the lab is one error line naming the extra."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fate_edge.apps import cli
from fate_edge.errors import FateEdgeError

SERVE = """
import sys
from fastapi.testclient import TestClient
import fate_edge.apps.cli
from fate_edge import Engine
from fate_edge.apps.server.app import create_app
from fate_edge.sdk import generate
with Engine.load(memory_budget="2MB") as engine:
    assert generate(engine, "def f(x):", max_tokens=4).completion_tokens == 4
    with TestClient(create_app(engine=engine), base_url="http://127.0.0.1") as client:
        r = client.post("/v1/completions", json={"model": "tiny-moe", "prompt": "def", "max_tokens": 4})
        assert r.status_code == 200, r.text
print(sorted(m for m in sys.modules if m.split(".")[0] == "fate_edge_lab"))
"""


@pytest.mark.slow
def test_serving_a_request_loads_no_lab_module():
    out = subprocess.run([sys.executable, "-c", SERVE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_a_lab_command_without_the_lab_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m.split(".")[0] == "fate_edge_lab"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "fate_edge_lab", None)  # as if the lab were not installed
    with pytest.raises(FateEdgeError, match=r"pip install 'fate-edge\[lab\]'"):
        cli.resolve(cli.COMMANDS["bench"][0])


def test_lab_commands_dispatch_to_the_lab():
    assert cli.resolve(cli.COMMANDS["synth"][0]).__module__ == "fate_edge_lab.synthetic.cli"
