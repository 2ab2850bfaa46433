"""Models named by a Hugging Face hub id or an Ollama name, found in the local caches; nothing is downloaded.

- Hugging Face: ``org/name`` in the hub cache (``$HF_HUB_CACHE``, ``$HF_HOME/hub``, ``~/.cache/huggingface/hub``):
  the snapshot ``refs/main`` points at (else the newest), a model directory or the GGUF in it
  (``org/name:Q4_0`` picks one of several GGUFs by a part of its file name).
- Ollama: ``name[:tag]`` or ``namespace/name[:tag]`` in the Ollama store (``$OLLAMA_MODELS``, ``~/.ollama/models``):
  the manifest's model layer, a GGUF blob.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from fate_edge.errors import ModelFormatError, ModelNotFoundError

OLLAMA_REGISTRY = "registry.ollama.ai"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"


def hf_hub_dirs() -> list[Path]:
    out = []
    if os.environ.get("HF_HUB_CACHE"):
        out.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        out.append(Path(os.environ["HF_HOME"]) / "hub")
    out.append(Path.home() / ".cache" / "huggingface" / "hub")
    return list(dict.fromkeys(out))


def ollama_dirs() -> list[Path]:
    out = [Path(os.environ["OLLAMA_MODELS"])] if os.environ.get("OLLAMA_MODELS") else []
    out.append(Path.home() / ".ollama" / "models")
    return list(dict.fromkeys(out))


def locate_model(model: str | Path) -> Path:
    """``model`` as a path when it exists, else the model that name refers to in the local caches."""
    path = Path(model)
    if path.exists() or isinstance(model, Path):
        return path
    name = str(model)
    found = find_hf(name) or find_ollama(name)
    if found is not None:
        return found
    looked = [str(d) for d in hf_hub_dirs()] + [str(d) for d in ollama_dirs()]
    raise ModelNotFoundError(
        f"{name}: not a file or directory, and no Hugging Face hub or Ollama model of that name "
        f"was found locally (looked in {', '.join(looked)}); fate-edge downloads nothing: fetch "
        "it with `huggingface-cli download` or `ollama pull`, or pass a path"
    )


def find_hf(name: str) -> Path | None:
    repo, _, pick = name.partition(":")
    if repo.count("/") != 1:
        return None
    folder = "models--" + repo.replace("/", "--")
    for hub in hf_hub_dirs():
        root = hub / folder
        snapshots = root / "snapshots"
        if not snapshots.is_dir():
            continue
        ref = root / "refs" / "main"
        snap = snapshots / ref.read_text().strip() if ref.is_file() else None
        if snap is None or not snap.is_dir():
            candidates = [p for p in snapshots.iterdir() if p.is_dir()]
            if not candidates:
                continue
            snap = max(candidates, key=lambda p: p.stat().st_mtime)
        ggufs = sorted(p for p in snap.glob("*.gguf") if pick.lower() in p.name.lower())
        if (snap / "config.json").exists() and not pick:
            return snap
        if len(ggufs) == 1:
            return ggufs[0]
        if ggufs:
            raise ModelNotFoundError(
                f"{name}: {snap} holds several GGUFs ({', '.join(p.name for p in ggufs)}); "
                f"name one as {repo}:PART (for example {repo}:{_quant_tag(ggufs[0].name)})"
            )
    return None


def _quant_tag(filename: str) -> str:
    return filename.removesuffix(".gguf").rsplit("-", 1)[-1].rsplit(".", 1)[-1]


def find_ollama(name: str) -> Path | None:
    base, _, tag = name.partition(":")
    parts = base.split("/")
    if not base or len(parts) > 3 or not all(parts):
        return None
    if len(parts) == 1:
        parts = ["library", *parts]
    if len(parts) == 2:
        parts = [OLLAMA_REGISTRY, *parts]
    for root in ollama_dirs():
        manifest = root.joinpath("manifests", *parts, tag or "latest")
        if not manifest.is_file():
            continue
        try:
            layers = json.loads(manifest.read_text()).get("layers", [])
        except json.JSONDecodeError as exc:
            raise ModelFormatError(f"{manifest}: not a valid Ollama manifest ({exc})") from exc
        for layer in layers:
            if layer.get("mediaType") == OLLAMA_MODEL_LAYER:
                blob = root / "blobs" / str(layer.get("digest", "")).replace(":", "-")
                if not blob.is_file():
                    raise ModelNotFoundError(
                        f"{name}: {manifest} names the model blob {blob.name}, which is not in "
                        f"{blob.parent}; run `ollama pull {name}` again"
                    )
                return blob
        raise ModelFormatError(f"{manifest}: has no {OLLAMA_MODEL_LAYER} layer; it is not a model fate-edge can run")
    return None
