"""Models named by a Hugging Face hub id or an Ollama name, found in the local caches; nothing is downloaded.

- Hugging Face: ``org/name`` in the hub cache (``$HF_HUB_CACHE``, ``$HF_HOME/hub``, ``~/.cache/huggingface/hub``),
  read through huggingface_hub's own cache API (``scan_cache_dir``), local only: the revision ``refs/main`` names
  (else the newest), a model directory or the GGUF in it (``org/name:Q4_K_M`` picks one of several GGUFs by a part
  of its file name).
- Ollama: ``name[:tag]``, ``namespace/name[:tag]`` or ``host/namespace/name[:tag]`` in the Ollama stores
  (``$OLLAMA_MODELS``, ``~/.ollama/models``, the Linux service's ``/usr/share/ollama/.ollama/models``): the
  manifest's model layer, a GGUF blob.

Every path is checked to stay inside its root before it is opened: a name part or tag may not hold ``..`` or a
separator, a manifest's digest must be ``sha256:`` and 64 hex digits, and what a manifest, blob or snapshot file
resolves to (symlinks followed) must lie under its store's or repo's folder.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from fate_edge.errors import ModelFormatError, ModelNotFoundError

OLLAMA_REGISTRY = "registry.ollama.ai"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_SERVICE_DIR = Path("/usr/share/ollama/.ollama/models")  # the Linux install script's service user
_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # one name part or a tag: never "..", never a separator
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,252}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def hf_hub_dirs() -> list[Path]:
    """The hub caches huggingface_hub itself would use, in its order ($HF_HUB_CACHE, $HF_HOME/hub, the default)."""
    out = []
    if os.environ.get("HF_HUB_CACHE"):
        out.append(Path(os.environ["HF_HUB_CACHE"]).expanduser())
    if os.environ.get("HF_HOME"):
        out.append(Path(os.environ["HF_HOME"]).expanduser() / "hub")
    xdg = os.environ.get("XDG_CACHE_HOME")
    out.append((Path(xdg) if xdg else Path.home() / ".cache") / "huggingface" / "hub")
    return list(dict.fromkeys(out))


def ollama_dirs() -> list[Path]:
    out = [Path(os.environ["OLLAMA_MODELS"]).expanduser()] if os.environ.get("OLLAMA_MODELS") else []
    out += [Path.home() / ".ollama" / "models", OLLAMA_SERVICE_DIR]
    return list(dict.fromkeys(out))


def looked_in() -> str:
    return ", ".join(str(d) for d in [*hf_hub_dirs(), *ollama_dirs()])


def locate_model(model: str | Path) -> Path:
    """``model`` as a path when it exists, else the model that name refers to in the local caches."""
    path = Path(model)
    if path.exists() or isinstance(model, Path):
        return path
    name = str(model)
    found = find_hf(name) or find_ollama(name)
    if found is not None:
        return found
    raise ModelNotFoundError(
        f"{name}: not a file or directory, and no Hugging Face hub or Ollama model of that name "
        f"was found locally (looked in {looked_in()}); fate-edge downloads nothing: fetch "
        "it with `huggingface-cli download` or `ollama pull`, or pass a path"
    )


def _inside(path: Path, root: Path) -> bool:
    """``path``, symlinks followed, lies under ``root`` (itself resolved)."""
    try:
        return path.resolve().is_relative_to(root.resolve())
    except (OSError, RuntimeError):  # a symlink loop
        return False


# --------------------------------------------------------------------------- Hugging Face
@dataclass(frozen=True)
class HFModel:
    repo_id: str
    snapshot: Path  # the chosen revision's folder (inside the repo's snapshots/)
    files: dict[str, Path]  # file name in the repo -> its path in the snapshot, each checked to stay in the repo


def hf_models(hub: Path) -> tuple[list[HFModel], list[str]]:
    """The model repos huggingface_hub's ``scan_cache_dir`` finds in ``hub``, each at the revision ``main`` names,
    else its newest; and the library's word on each repo it found damaged (left out: a ref that names no snapshot,
    ``../..`` say, a snapshot file whose blob is missing)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(hub)
    except (CacheNotFound, OSError):
        return [], []
    out = []
    for repo in info.repos:
        if repo.repo_type != "model" or not repo.revisions:
            continue
        rev = max(repo.revisions, key=lambda r: ("main" in r.refs, r.last_modified))
        files = {
            f.file_path.relative_to(rev.snapshot_path).as_posix(): f.file_path
            for f in rev.files
            if _inside(f.file_path, hub)  # a snapshot file links into the cache's blobs, never outside it
        }
        out.append(HFModel(repo.repo_id, rev.snapshot_path, files))
    return out, [str(w) for w in info.warnings]


def find_hf(name: str) -> Path | None:
    repo, _, pick = name.partition(":")
    if repo.count("/") != 1 or not all(_PART.fullmatch(p) for p in repo.split("/")):
        return None
    for hub in hf_hub_dirs():
        folder = hub / ("models--" + repo.replace("/", "--"))
        if not folder.is_dir():
            continue
        models, damaged = hf_models(hub)
        model = next((m for m in models if m.repo_id.lower() == repo.lower()), None)
        if model is None:
            why = next((w for w in damaged if str(folder) in w), None)
            if why is not None:
                raise ModelFormatError(
                    f"{name}: huggingface_hub reports its cache entry damaged ({why}); download it again"
                )
            continue
        if "config.json" in model.files and not pick:
            return model.snapshot
        ggufs = sorted(
            (n for n in model.files if n.endswith(".gguf") and "/" not in n and pick.lower() in n.lower()),
            key=str.lower,
        )
        if len(ggufs) == 1:
            return model.files[ggufs[0]]
        if ggufs:
            raise ModelNotFoundError(
                f"{name}: {model.snapshot} holds several GGUFs ({', '.join(ggufs)}); "
                f"name one as {repo}:PART (for example {repo}:{_quant_tag(ggufs[0])})"
            )
    return None


def _quant_tag(filename: str) -> str:
    return filename.removesuffix(".gguf").rsplit("-", 1)[-1].rsplit(".", 1)[-1]


# --------------------------------------------------------------------------- Ollama
def ollama_parts(name: str) -> list[str] | None:
    """[host, namespace, model, tag] of an Ollama name, or None for a name that is not one (nor safe as a path)."""
    base, colon, tag = name.partition(":")
    tag = tag if colon else "latest"
    parts = base.split("/")
    if len(parts) > 3 or not _PART.fullmatch(tag) or not all(_PART.fullmatch(p) for p in parts[-2:]):
        return None
    if len(parts) == 3 and not _HOST.fullmatch(parts[0]):
        return None
    return [OLLAMA_REGISTRY, "library"][: 3 - len(parts)] + parts + [tag]


def find_ollama(name: str) -> Path | None:
    parts = ollama_parts(name)
    if parts is None:
        return None
    for root in ollama_dirs():
        manifests = root / "manifests"
        manifest = manifests.joinpath(*parts)
        if not manifest.is_file():
            continue
        if not _inside(manifest, manifests):
            raise ModelFormatError(f"{manifest}: links outside {manifests}; fate-edge does not follow it")
        return ollama_blob(root, manifest, name)
    return None


def read_manifest(manifest: Path) -> list[dict]:
    """The layers of an Ollama manifest; one line naming the file for anything not shaped as Ollama writes it."""
    try:
        data = json.loads(manifest.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ModelFormatError(f"{manifest}: not an Ollama manifest (not UTF-8 text: {exc.reason})") from None
    except json.JSONDecodeError as exc:
        raise ModelFormatError(f"{manifest}: not a valid Ollama manifest ({exc})") from None
    layers = data.get("layers") if isinstance(data, dict) else None
    if not isinstance(layers, list) or not all(isinstance(layer, dict) for layer in layers):
        raise ModelFormatError(
            f"{manifest}: not an Ollama manifest (expected a JSON object whose 'layers' is a list of objects)"
        )
    return layers


def ollama_blob(root: Path, manifest: Path, name: str) -> Path:
    """The GGUF blob ``manifest``'s model layer names, inside ``root``/blobs."""
    for layer in read_manifest(manifest):
        if layer.get("mediaType") != OLLAMA_MODEL_LAYER:
            continue
        digest = layer.get("digest")
        if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            raise ModelFormatError(
                f"{manifest}: the model layer's digest {digest!r} is not sha256: and 64 hex digits; "
                "the manifest is damaged: run `ollama pull` again"
            )
        blobs = root / "blobs"
        blob = blobs / digest.replace(":", "-")
        if not blob.is_file():
            raise ModelNotFoundError(
                f"{name}: {manifest} names the model blob {blob.name}, which is not in {blobs}; run `ollama pull "
                f"{name}` again"
            )
        if not _inside(blob, blobs):
            raise ModelFormatError(f"{blob}: links outside {blobs}; fate-edge does not follow it")
        return blob
    raise ModelFormatError(f"{manifest}: has no {OLLAMA_MODEL_LAYER} layer; it is not a model fate-edge can run")


def ollama_models(root: Path) -> list[tuple[str, Path]]:
    """(name as Ollama lists it, manifest) of every manifest under ``root``/manifests."""
    manifests = root / "manifests"
    out = []
    for m in sorted(manifests.glob("*/*/*/*")) if manifests.is_dir() else []:
        host, ns, model, tag = m.relative_to(manifests).parts
        if not m.is_file() or ollama_parts(f"{host}/{ns}/{model}:{tag}") is None:
            continue
        short = model if (host, ns) == (OLLAMA_REGISTRY, "library") else f"{ns}/{model}"
        out.append((f"{short if host == OLLAMA_REGISTRY else f'{host}/{ns}/{model}'}:{tag}", m))
    return out
