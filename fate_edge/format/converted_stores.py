"""Expert stores converted on demand into a cache directory, so a plain model directory just works."""

from __future__ import annotations

import hashlib
from pathlib import Path

from fate_edge.app_dirs import cache_home
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.format.store import is_store
from fate_edge.quant.native import native_isa


def cache_root() -> Path:
    return cache_home() / "stores"


def ensure_store(model_dir: str | Path, bits: int = 4, cold_bits: int | None = 2, progress: bool = True) -> Path:
    """``model_dir`` itself if it is a store, else its converted store in the cache (made once)."""
    model_dir = Path(model_dir)
    if is_store(model_dir):
        return model_dir
    # Key the cached store by the source's path, weight-file sizes and times, and the precisions.
    h = hashlib.sha256(str(model_dir.resolve()).encode())
    for f in sorted([*model_dir.glob("*.safetensors"), *model_dir.glob("predictors/*")]):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    # convert's auto layout depends on the kernel this host prefers: a store made for the other one still works,
    # but would compute on the slower kernel, so each preference keeps its own
    h.update(f"{bits}/{cold_bits}/{'native' if native_isa() == 'avx512-vnni' else 'torch'}".encode())
    out = cache_root() / f"{model_dir.name}-int{bits}-{h.hexdigest()[:12]}"
    if not is_store(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        convert(model_dir, out, ConvertOptions(bits=bits, cold_bits=cold_bits, force=True), progress=progress)
    return out
