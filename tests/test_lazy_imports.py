"""A run loads only what it uses: no onnxruntime without an ONNX predictor, nothing of transformers (a test
dependency, never a runtime one)."""

import json
import subprocess
import sys

import pytest

OPTIONAL = ("onnxruntime", "transformers", "onnx", "onnxscript")

_ENGINE_RUN = """
import json, sys
from fate_edge import Engine, GenerateConfig
with Engine.load(None, memory_budget="4MB", policy=sys.argv[1]) as engine:
    engine.generate_text("def main():", GenerateConfig(max_tokens=4))
import fate_edge.apps.cli, fate_edge.apps.server.app  # the entry points, imported as `run` and `serve` import them
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in {opt}) ))
"""


def _loaded_after(code: str, *args: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", code.replace("{opt}", repr(set(OPTIONAL))), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("policy", ["fate-edge", "lru"])
@pytest.mark.slow
def test_an_engine_run_imports_neither_onnxruntime_nor_transformers(policy):
    assert _loaded_after(_ENGINE_RUN, policy) == []


@pytest.mark.slow
def test_the_check_sees_a_module_that_is_imported():
    # The same probe after importing onnxruntime on purpose: it would catch an engine that did.
    assert "onnxruntime" in _loaded_after("import onnxruntime\n" + _ENGINE_RUN, "lru")
