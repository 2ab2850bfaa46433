"""``--model`` by name: a Hugging Face hub id in the local hub cache, an Ollama name in the local Ollama store (fake
caches under tmp_path); a name in neither is a one-line error saying where fate-edge looked. Nothing is downloaded."""

from __future__ import annotations

import json
import shutil

import pytest

from fate_edge.errors import ModelNotFoundError
from fate_edge.format.converted_stores import ensure_store
from fate_edge.format.model_names import locate_model
from fate_edge.format.store import ExpertStore


@pytest.fixture
def caches(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_HOME", raising=False)
    return tmp_path


def _hf_snapshot(caches, repo: str) -> object:
    root = caches / "hub" / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("abc123")
    return snap


def test_hf_hub_id_finds_the_snapshot_directory(caches, bundled_dir):
    snap = _hf_snapshot(caches, "fate/tiny-moe")
    for f in bundled_dir.iterdir():
        if f.is_file():
            shutil.copy2(f, snap / f.name)
    assert locate_model("fate/tiny-moe") == snap


def test_hf_hub_id_finds_a_gguf_and_asks_which_of_several(caches):
    snap = _hf_snapshot(caches, "org/model-GGUF")
    (snap / "model-Q4_0.gguf").write_bytes(b"GGUF")
    assert locate_model("org/model-GGUF") == snap / "model-Q4_0.gguf"
    (snap / "model-Q8_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError, match="several GGUFs"):
        locate_model("org/model-GGUF")
    assert locate_model("org/model-GGUF:q8_0") == snap / "model-Q8_0.gguf"


def test_ollama_name_finds_the_model_blob_and_runs(caches, tmp_path):
    from _gguf_writer import write_gguf

    from fate_edge import bundled_model_dir

    blobs = caches / "ollama" / "blobs"
    blobs.mkdir(parents=True)
    digest = "sha256:" + "ab" * 32
    write_gguf(bundled_model_dir(), blobs / digest.replace(":", "-"), "Q4_0", "F32")
    manifest = caches / "ollama" / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "q4"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(
        json.dumps(
            {
                "layers": [
                    {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:00"},
                    {"mediaType": "application/vnd.ollama.image.model", "digest": digest},
                ]
            }
        )
    )
    assert locate_model("tiny:q4") == blobs / digest.replace(":", "-")
    store = ensure_store("tiny:q4", progress=False)
    assert ExpertStore(store).bits_available == [4]  # lean: what the default policy reads


def test_a_name_in_no_cache_says_where_it_looked(caches):
    with pytest.raises(ModelNotFoundError) as err:
        locate_model("nobody/nothing")
    msg = str(err.value)
    assert "\n" not in msg and str(caches / "hub") in msg and str(caches / "ollama") in msg
    assert "downloads nothing" in msg
