"""``fate-edge list``: the models in the local Hugging Face and Ollama caches, each with its architecture, parameter
count and file size, and whether fate-edge has converted it (the store's size when it has).

Only headers are read: a safetensors file's JSON header, a GGUF's metadata and tensor table. A model that cannot be
read is listed with the reason, never a traceback.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from fate_edge.errors import FateEdgeError
from fate_edge.format.model_names import (
    _PART,
    HFModel,
    hf_hub_dirs,
    hf_models,
    ollama_blob,
    ollama_dirs,
    ollama_models,
)
from fate_edge.sizes import format_bytes

MAX_HEADER = 100 << 20  # a safetensors JSON header larger than this is not one fate-edge reads


@dataclass
class ListedModel:
    name: str  # as --model takes it
    source: str  # "huggingface" or "ollama"
    path: Path | None  # model directory or GGUF file; None when it could not be found
    architecture: str = "?"
    params: int | None = None
    file_bytes: int = 0
    store_bytes: int | None = None  # the converted store's size; None: not converted
    problem: str = ""  # why it could not be read


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _safetensors_params(path: Path) -> int:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_HEADER:
            raise FateEdgeError(f"{path.name}: a {n}-byte header is not a safetensors header")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise FateEdgeError(f"{path.name}: the safetensors header is not a JSON object")
    return sum(
        math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__" and isinstance(v, dict) and "shape" in v
    )


def _describe_dir(m: ListedModel) -> None:
    assert m.path is not None
    config = json.loads((m.path / "config.json").read_text(encoding="utf-8"))
    if isinstance(config, dict):
        m.architecture = str(config.get("model_type") or (config.get("architectures") or ["?"])[0])
    files = sorted(m.path.glob("*.safetensors"))
    m.params = sum(_safetensors_params(f) for f in files) if files else None
    m.file_bytes = sum(f.stat().st_size for f in m.path.iterdir() if f.is_file())


def _describe_gguf(m: ListedModel) -> None:
    from fate_edge.format.gguf_header import read_header

    assert m.path is not None
    header = read_header(m.path)
    m.architecture = str(header.fields.get("general.architecture", "?"))
    m.params = sum(math.prod(t.dims) for t in header.tensors)
    m.file_bytes = m.path.stat().st_size


def describe(m: ListedModel) -> ListedModel:
    """Fill ``m``'s architecture, parameters, sizes and store from its files; a failure goes to ``m.problem``."""
    from fate_edge.format.converted_stores import cached_store_path
    from fate_edge.format.gguf_reader import is_gguf
    from fate_edge.format.store import is_store

    if m.path is None:
        return m
    try:
        (_describe_gguf if is_gguf(m.path) else _describe_dir)(m)
        store = cached_store_path(m.name, m.path)
        if is_store(store):
            m.store_bytes = _dir_bytes(store)
    except (OSError, ValueError, struct.error, FateEdgeError, KeyError, TypeError) as exc:
        m.problem = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
    return m


def _hf_entries(model: HFModel) -> list[ListedModel]:
    if "config.json" in model.files:
        return [ListedModel(model.repo_id, "huggingface", model.snapshot)]
    ggufs = sorted(n for n in model.files if n.endswith(".gguf") and "/" not in n)
    out = []
    for g in ggufs:
        tag = g.removesuffix(".gguf").rsplit("-", 1)[-1].rsplit(".", 1)[-1]
        if sum(tag.lower() in other.lower() for other in ggufs) != 1 or not _PART.fullmatch(tag):
            tag = g.removesuffix(".gguf")
        name = model.repo_id if len(ggufs) == 1 else f"{model.repo_id}:{tag}"
        out.append(ListedModel(name, "huggingface", model.files[g]))
    return out


def find_models() -> list[ListedModel]:
    """Every model in the local caches, described (the Hugging Face hub caches first, then the Ollama stores)."""
    found: list[ListedModel] = []
    for hub in hf_hub_dirs():
        models, damaged = hf_models(hub) if hub.is_dir() else ([], [])
        for model in models:
            found += _hf_entries(model)
        found += [ListedModel("?", "huggingface", None, problem=w.splitlines()[0][:160]) for w in damaged]
    for root in ollama_dirs():
        for name, manifest in ollama_models(root):
            try:
                found.append(ListedModel(name, "ollama", ollama_blob(root, manifest, name)))
            except FateEdgeError as exc:
                found.append(ListedModel(name, "ollama", None, problem=str(exc)))
    unique: dict[str, ListedModel] = {}
    for i, m in enumerate(found):  # the first of a name is the one --model NAME resolves to
        unique.setdefault(m.name if m.path is not None else f"?{i}", m)
    return [describe(m) for m in unique.values()]


def format_models(models: list[ListedModel]) -> str:
    rows = [["NAME", "SOURCE", "ARCH", "PARAMS", "SIZE", "CONVERTED"]]
    for m in models:
        params = "?" if not m.params else f"{m.params / 1e9:.2f}B" if m.params >= 1e8 else f"{m.params / 1e6:.1f}M"
        store = f"yes, store {format_bytes(m.store_bytes)}" if m.store_bytes is not None else "no"
        if m.problem:
            rows.append([m.name, m.source, "?", "?", format_bytes(m.file_bytes) if m.file_bytes else "?", m.problem])
        else:
            rows.append([m.name, m.source, m.architecture, params, format_bytes(m.file_bytes), store])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows)
