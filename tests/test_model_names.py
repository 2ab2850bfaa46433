"""``--model`` by name: a Hugging Face hub id in the local hub cache, an Ollama name in the local Ollama store (fake
caches under tmp_path); a name in neither is a one-line error saying where fate-edge looked. Nothing is downloaded."""

from __future__ import annotations

import json
import shutil

import pytest

from fate_edge.errors import ModelFormatError, ModelNotFoundError
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


# --------------------------------------------------------------------------- reads from outside a model's root
# Each of these read a file outside the Ollama store or the hub cache, or raised a raw TypeError / AttributeError /
# UnicodeDecodeError, before the names, tags and digests were checked (issue 54 item 7).
MODEL_LAYER = "application/vnd.ollama.image.model"


def _manifest(path, layers) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"layers": layers}))


def test_an_ollama_tag_with_dotdot_reads_no_manifest_outside_the_store(caches):
    secret = caches / "elsewhere" / "manifest"
    (caches / "elsewhere").mkdir()
    digest = "sha256:" + "ab" * 32
    (caches / "ollama" / "blobs").mkdir(parents=True)
    (caches / "ollama" / "blobs" / digest.replace(":", "-")).write_bytes(b"GGUF")  # the old code returned it
    _manifest(secret, [{"mediaType": MODEL_LAYER, "digest": digest}])
    (caches / "ollama" / "manifests" / "registry.ollama.ai" / "library" / "tiny").mkdir(parents=True)
    for name in ("tiny:../../../../../elsewhere/manifest", "../../elsewhere/manifest", "x/../../y:z"):
        with pytest.raises(ModelNotFoundError):
            locate_model(name)


@pytest.mark.parametrize("digest", ["ABSOLUTE", "../outside.gguf", 7, None])
def test_a_manifest_digest_is_not_followed_out_of_blobs(caches, digest):
    outside = caches / "outside.gguf"
    outside.write_bytes(b"GGUF")
    (caches / "ollama" / "blobs").mkdir(parents=True)
    (caches / "ollama" / "outside.gguf").write_bytes(b"GGUF")  # where ../outside.gguf leads from blobs/
    (caches / "ollama" / "blobs" / "7").write_bytes(b"GGUF")  # and a digest of 7, taken as text
    (caches / "ollama" / "blobs" / "None").write_bytes(b"GGUF")
    digest = str(outside) if digest == "ABSOLUTE" else digest
    _manifest(
        caches / "ollama" / "manifests" / "registry.ollama.ai" / "library" / "m" / "latest",
        [{"mediaType": MODEL_LAYER, "digest": digest}],
    )
    with pytest.raises(ModelFormatError, match="is not sha256: and 64 hex digits") as err:
        locate_model("m")
    assert "\n" not in str(err.value)


def test_a_blob_that_links_outside_blobs_is_not_followed(caches):
    outside = caches / "outside.gguf"
    outside.write_bytes(b"GGUF")
    digest = "sha256:" + "cd" * 32
    (caches / "ollama" / "blobs").mkdir(parents=True)
    (caches / "ollama" / "blobs" / digest.replace(":", "-")).symlink_to(outside)
    _manifest(
        caches / "ollama" / "manifests" / "registry.ollama.ai" / "library" / "m" / "latest",
        [{"mediaType": MODEL_LAYER, "digest": digest}],
    )
    with pytest.raises(ModelFormatError, match="links outside"):
        locate_model("m")


@pytest.mark.parametrize(
    "content", [b"\xff\xfe\x00garbage", b"[]", b'{"layers": 5}', b'{"layers": ["x"]}', b'"text"', b"{not json"]
)
def test_a_wrong_shaped_or_binary_manifest_is_one_line(caches, content):
    manifest = caches / "ollama" / "manifests" / "registry.ollama.ai" / "library" / "m" / "latest"
    manifest.parent.mkdir(parents=True)
    manifest.write_bytes(content)
    with pytest.raises(ModelFormatError) as err:
        locate_model("m")
    assert str(manifest) in str(err.value) and "\n" not in str(err.value)


def test_a_hub_ref_of_dotdot_does_not_escape_snapshots(caches):
    root = caches / "hub" / "models--org--m"
    (root / "snapshots" / "abc123").mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("../../outside")
    (caches / "hub" / "outside").mkdir()
    (caches / "hub" / "outside" / "model-Q4_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelFormatError, match="reports its cache entry damaged") as err:
        locate_model("org/m")
    assert "\n" not in str(err.value)


def test_a_hub_file_that_links_outside_the_cache_is_not_offered(caches):
    snap = _hf_snapshot(caches, "org/m")
    outside = caches / "outside-Q4_0.gguf"
    outside.write_bytes(b"GGUF")
    (snap / "m-Q4_0.gguf").symlink_to(outside)
    with pytest.raises(ModelNotFoundError):
        locate_model("org/m")
