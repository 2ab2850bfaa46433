"""Expert stores converted on demand into a cache directory, so a plain model directory (or a GGUF file, or a model
named by its Hugging Face id or Ollama name and found in the local caches) just works."""

from __future__ import annotations

import hashlib
import logging
import re
import sys
from pathlib import Path

from fate_edge.app_dirs import cache_home
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.format.convert_progress import LoadStatus, ProgressLines
from fate_edge.format.gguf_convert import convert_gguf
from fate_edge.format.gguf_reader import is_gguf
from fate_edge.format.model_names import locate_model
from fate_edge.format.store import is_store
from fate_edge.quant.native import native_is_default


def cache_root() -> Path:
    return cache_home() / "stores"


def _label(model: str | Path, found: Path) -> str:
    """The cached store's folder name: the name the user gave (``qwen3:30b`` -> ``qwen3-30b``) rather than an Ollama
    blob's digest, else the file or folder name."""
    if not isinstance(model, Path) and not Path(model).exists():
        return re.sub(r"[^A-Za-z0-9._-]+", "-", str(model)).strip("-.") or found.name
    return found.name.removesuffix(".gguf")


def cached_store_path(model: str | Path, found: Path | None = None, bits: int = 4, cold_bits: int | None = 2) -> Path:
    """Where :func:`ensure_store` keeps (or will keep) the store converted from ``model`` (``found``: where it
    resolved to, else resolved here)."""
    model_dir = found or locate_model(model)
    gguf = is_gguf(model_dir)
    # Key the cached store by the source's path, weight-file sizes and times, and the precisions.
    h = hashlib.sha256(str(model_dir.resolve()).encode())
    files = [model_dir] if gguf else sorted([*model_dir.glob("*.safetensors"), *model_dir.glob("predictors/*")])
    for f in files:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    # convert's auto layout depends on the kernel this host prefers: a store made for the other one still works,
    # but would compute on the slower kernel, so each preference keeps its own
    h.update(f"{bits}/{cold_bits}/{'native' if native_is_default() else 'torch'}".encode())
    key = f"-int{bits}-{h.hexdigest()[:12]}"
    # the same source named another way (an Ollama name, then its blob's path) has its store already
    made = [p for p in cache_root().glob(f"*{key}") if not p.name.startswith(".") and is_store(p)]
    return made[0] if made else cache_root() / f"{_label(model, model_dir)}{key}"


def ensure_store(
    model_dir: str | Path,
    bits: int = 4,
    cold_bits: int | None = 2,
    progress: bool = True,
    status: LoadStatus | None = None,
) -> Path:
    """``model_dir`` itself if it is a store, else its converted store in the cache (made once). A GGUF file
    converts the same way; a name that is not a path is looked up in the local Hugging Face and Ollama caches.

    A conversion says so first, then shows its progress: on stderr with ``progress`` (a bar on a terminal, else a
    line every few seconds with bytes, rate and time left), in the ``fate_edge.convert`` log without; ``status``
    follows it (the daemon's /health). A conversion stopped part way (Ctrl-C, kill -9) leaves no store: it is
    written in a hidden working folder renamed into place last (work_dirs), and the next use starts it again."""
    found = locate_model(model_dir)
    if is_store(found):
        return found
    out = cached_store_path(model_dir, found, bits, cold_bits)
    gguf = is_gguf(found)
    if not is_store(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        log = logging.getLogger("fate_edge.convert")
        say = (lambda m: print(f"[convert] {m}", file=sys.stderr, flush=True)) if progress else log.info
        say(f"first use of {model_dir}: converting it once into an expert store ({out})")
        lines = ProgressLines(str(model_dir), None if progress and sys.stderr.isatty() else say, status=status)
        if gguf:  # the streamed precision is the file's own where its blocks fit (q8_0 -> int8)
            opts = ConvertOptions(bits=None, cold_bits=cold_bits, force=True)
            convert_gguf(found, out, opts, progress=progress, on_progress=lines)
        else:
            opts = ConvertOptions(bits=bits, cold_bits=cold_bits, force=True)
            convert(found, out, opts, progress=progress, on_progress=lines)
    return out
