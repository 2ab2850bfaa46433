"""Expert stores converted on demand into a cache directory, so a plain model directory (or a GGUF file, or a model
named by its Hugging Face id or Ollama name and found in the local caches) just works."""

from __future__ import annotations

import hashlib
from pathlib import Path

from fate_edge.app_dirs import cache_home
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.format.gguf_convert import convert_gguf
from fate_edge.format.gguf_reader import is_gguf
from fate_edge.format.model_names import locate_model
from fate_edge.format.store import is_store
from fate_edge.quant.native import native_is_default


def cache_root() -> Path:
    return cache_home() / "stores"


def ensure_store(model_dir: str | Path, bits: int = 4, cold_bits: int | None = 2, progress: bool = True) -> Path:
    """``model_dir`` itself if it is a store, else its converted store in the cache (made once). A GGUF file
    converts the same way; a name that is not a path is looked up in the local Hugging Face and Ollama caches."""
    model_dir = locate_model(model_dir)
    if is_store(model_dir):
        return model_dir
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
    name = model_dir.name.removesuffix(".gguf") if gguf else model_dir.name
    out = cache_root() / f"{name}-int{bits}-{h.hexdigest()[:12]}"
    if not is_store(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        if gguf:  # the streamed precision is the file's own where its blocks fit (q8_0 -> int8)
            convert_gguf(model_dir, out, ConvertOptions(bits=None, cold_bits=cold_bits, force=True), progress=progress)
        else:
            convert(model_dir, out, ConvertOptions(bits=bits, cold_bits=cold_bits, force=True), progress=progress)
    return out
