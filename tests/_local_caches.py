"""Fake local model caches for tests: an Ollama store (manifest + blobs as Ollama lays them out) and a Hugging Face
hub cache in huggingface_hub's documented layout (blobs/, snapshots/<commit>/ links into them, refs/main)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

OLLAMA_MODEL = "application/vnd.ollama.image.model"


def ollama_add(root: Path, name: str, tag: str, gguf: Path, namespace: str = "library") -> Path:
    """Place ``gguf`` in the Ollama store ``root`` as ``name:tag``: its blob, and a manifest naming it."""
    data = gguf.read_bytes()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blob = root / "blobs" / digest.replace(":", "-")
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    config = b'{"model_format":"gguf"}'
    config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
    (root / "blobs" / config_digest.replace(":", "-")).write_bytes(config)
    manifest = root / "manifests" / "registry.ollama.ai" / namespace / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(
        json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": {
                    "mediaType": "application/vnd.docker.container.image.v1+json",
                    "digest": config_digest,
                    "size": len(config),
                },
                "layers": [{"mediaType": OLLAMA_MODEL, "digest": digest, "size": len(data)}],
            }
        )
    )
    return blob


def hf_add(hub: Path, repo_id: str, files: dict[str, Path], commit: str = "0" * 40) -> Path:
    """Place ``files`` (name in the repo -> source file) in the hub cache ``hub`` as huggingface_hub does: each
    file's bytes in blobs/ under its hash, linked from snapshots/<commit>/, with refs/main naming the commit."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, src in files.items():
        data = src.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snap
