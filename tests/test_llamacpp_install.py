"""scripts/install_llamacpp.sh leaves a working llama.cpp peer in a clean virtual environment: the wheel's own
requirements installed (diskcache was once missing, so `import llama_cpp` failed). Runs where the wheel for this
host's flags is already built in the peers cache; building it takes ~20 minutes on 2 cores, so elsewhere it skips."""

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("FATE_EDGE_PEERS_CACHE", Path.home() / ".cache" / "fate-edge-peers"))


def _built_wheels() -> list[Path]:
    return sorted(CACHE.glob("wheels/*/llama_cpp_python-*.whl"))


@pytest.mark.skipif(
    not _built_wheels(),
    reason=f"no llama-cpp-python wheel built in {CACHE}/wheels "
    "(run scripts/install_llamacpp.sh once; it builds one in ~20 min)",
)
@pytest.mark.slow
def test_the_install_script_works_in_a_clean_venv(tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    env = {**os.environ, "PATH": f"{env_dir / 'bin'}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(env_dir)}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "install_llamacpp.sh")], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    check = subprocess.run(
        [str(env_dir / "bin" / "python"), "-c", "import llama_cpp, diskcache; print(llama_cpp.__version__)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0, check.stderr[-2000:]
    assert check.stdout.strip().startswith("0.")
    assert sys.prefix != str(env_dir)  # the venv was a new one, not this interpreter's
