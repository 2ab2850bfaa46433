import shutil
from pathlib import Path

import pytest
import torch

from fate_edge import Tokenizer, bundled_model_dir, load_model

torch.set_num_threads(2)


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    """Stores converted on demand go to a temporary cache, never the user's ~/.cache."""
    import os

    old = os.environ.get("FATE_EDGE_CACHE")
    os.environ["FATE_EDGE_CACHE"] = str(tmp_path_factory.mktemp("fate-edge-cache"))
    # --dtype auto measures on a CPU with bf16 instructions (runtime.compute_dtype, tested in test_compute_dtype):
    # the suite's expected numbers are float32's on every host
    os.environ.setdefault("FATE_EDGE_DTYPE", "float32")
    yield
    if old is None:
        os.environ.pop("FATE_EDGE_CACHE", None)
    else:
        os.environ["FATE_EDGE_CACHE"] = old


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module whose many tiny ops only lose time to a second thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def bundled_dir() -> Path:
    return bundled_model_dir()


@pytest.fixture(scope="session")
def bundled_model(bundled_dir):
    return load_model(bundled_dir)


@pytest.fixture(scope="session")
def bundled_tokenizer(bundled_dir):
    return Tokenizer(bundled_dir)


@pytest.fixture()
def model_copy(tmp_path, bundled_dir) -> Path:
    """A writable copy of the bundled model, for tests that damage it."""
    dst = tmp_path / "model"
    shutil.copytree(bundled_dir, dst)
    return dst


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip where torch sees no CUDA GPU (docs/testing.md: ``-m gpu`` on a GPU machine)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch sees none here)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def baseline_store(bundled_dir) -> Path:
    """The bundled model's store with what the baselines read, asked for: the bf16 expert copy (load-on-demand),
    Fate's int2 copy and float resident weights (the default store holds only what the default policy reads)."""
    from fate_edge.format.converted_stores import ensure_store

    return ensure_store(bundled_dir, cold_bits=2, progress=False, baselines=True)


@pytest.fixture(scope="session")
def default_server(tmp_path_factory):
    """One daemon with the default settings (tests/test_server.py's ``Server(cache)``), for the modules whose tests
    need nothing else of it and compare its metrics only before and after their own requests: starting one costs a
    Python with torch, fate-edge and the model (~5 s)."""
    from test_server import Server

    s = Server(tmp_path_factory.mktemp("fe-default-server"))
    yield s
    s.stop()
