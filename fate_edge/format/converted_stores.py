"""Expert stores converted on demand into a cache directory, so a plain model directory (or a GGUF file, or a model
named by its Hugging Face id or Ollama name and found in the local caches) just works."""

from __future__ import annotations

import hashlib
import logging
import re
import sys
from dataclasses import replace
from pathlib import Path

from fate_edge.app_dirs import cache_home
from fate_edge.format.convert import EMBEDDING_BITS, RESIDENT_BITS, ConvertOptions, convert
from fate_edge.format.convert_progress import LoadStatus, ProgressLines
from fate_edge.format.gguf_convert import convert_gguf
from fate_edge.format.gguf_reader import is_gguf
from fate_edge.format.model_names import locate_model
from fate_edge.format.store import is_store
from fate_edge.format.store_age import predates_block_order
from fate_edge.process_memory import release_freed_memory
from fate_edge.quant.native import native_is_default


def cache_root() -> Path:
    return cache_home() / "stores"


def _label(model: str | Path, found: Path) -> str:
    """The cached store's folder name: the name the user gave (``qwen3:30b`` -> ``qwen3-30b``) rather than an Ollama
    blob's digest, else the file or folder name."""
    if not isinstance(model, Path) and not Path(model).exists():
        return re.sub(r"[^A-Za-z0-9._-]+", "-", str(model)).strip("-.") or found.name
    return found.name.removesuffix(".gguf")


def store_options(
    gguf: bool,
    bits: int = 4,
    cold_bits: int | None = None,
    baselines: bool = False,
    resident_bits: int | None = RESIDENT_BITS,
    embedding_bits: int | None = EMBEDDING_BITS,
) -> ConvertOptions:
    """What a cached store is converted with: lean by default (``ConvertOptions``), or with the baselines' copies."""
    opts = (
        ConvertOptions.full()
        if baselines
        else ConvertOptions(resident_bits=resident_bits, embedding_bits=embedding_bits)
    )
    return replace(opts, bits=None if gguf else bits, cold_bits=cold_bits, force=True)


def cached_store_path(
    model: str | Path,
    found: Path | None = None,
    bits: int = 4,
    cold_bits: int | None = None,
    opts: ConvertOptions | None = None,
) -> Path:
    """Where :func:`ensure_store` keeps (or will keep) the store converted from ``model`` (``found``: where it
    resolved to, else resolved here) with ``opts`` (default: the lean store)."""
    model_dir = found or locate_model(model)
    gguf = is_gguf(model_dir)
    opts = opts or store_options(gguf, bits, cold_bits)
    # Key the cached store by the source's path, weight-file sizes and times, and everything the store holds.
    h = hashlib.sha256(str(model_dir.resolve()).encode())
    files = [model_dir] if gguf else sorted([*model_dir.glob("*.safetensors"), *model_dir.glob("predictors/*")])
    for f in files:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    # convert's auto layout depends on the kernel this host prefers: a store made for the other one still works,
    # but would compute on the slower kernel, so each preference keeps its own. torch's layout records its CPU block
    # order in the store (another order re-packs), and a store cached before it did is converted again in place by
    # ensure_store (format.store_age): the order is no part of the key
    kernel = "native" if native_is_default() else "torch"
    h.update(f"{bits}/{cold_bits}/{kernel}".encode())
    # the resident precisions and the kept copies (a store cached before they were defaults held bf16 experts and
    # float resident weights: another key, so it is not taken for the lean one)
    h.update(f"/bf16={opts.keep_bf16}/r{opts.resident_bits}/e{opts.embedding_bits}/h{opts.head_bits}".encode())
    key = f"-int{bits}-{h.hexdigest()[:12]}"
    # the same source named another way (an Ollama name, then its blob's path) has its store already
    made = [p for p in cache_root().glob(f"*{key}") if not p.name.startswith(".") and is_store(p)]
    return made[0] if made else cache_root() / f"{_label(model, model_dir)}{key}"


def ensure_store(
    model_dir: str | Path,
    bits: int = 4,
    cold_bits: int | None = None,
    progress: bool = True,
    status: LoadStatus | None = None,
    baselines: bool = False,
    resident_bits: int | None = RESIDENT_BITS,
    embedding_bits: int | None = EMBEDDING_BITS,
) -> Path:
    """``model_dir`` itself if it is a store, else its converted store in the cache (made once). A GGUF file
    converts the same way; a name that is not a path is looked up in the local Hugging Face and Ollama caches.

    The store is lean: what the default policy reads (the ``bits`` experts, resident weights and embedding table
    quantized as ``ConvertOptions`` says), nothing else. ``cold_bits`` adds a low-precision copy (Fate's int2 tail);
    ``baselines`` (the bench, the demo) keeps the bf16 experts and the resident weights as in the checkpoint, for
    the policies and load options that compare against them. ``resident_bits``/``embedding_bits``: the precisions
    a run asks for (``run --resident-bits 8``), quantized at convert so the load reads them as they are.

    A conversion says so first, then shows its progress: on stderr with ``progress`` (a bar on a terminal, else a
    line every few seconds with bytes, rate and time left), in the ``fate_edge.convert`` log without; ``status``
    follows it (the daemon's /health). A conversion stopped part way (Ctrl-C, kill -9) leaves no store: it is
    written in a hidden working folder renamed into place last (work_dirs), and the next use starts it again."""
    found = locate_model(model_dir)
    if is_store(found):
        return found
    gguf = is_gguf(found)
    opts = store_options(gguf, bits, cold_bits, baselines, resident_bits, embedding_bits)
    out = cached_store_path(model_dir, found, bits, cold_bits, opts)
    outdated = is_store(out) and predates_block_order(out)
    if not is_store(out) or outdated:
        out.parent.mkdir(parents=True, exist_ok=True)
        log = logging.getLogger("fate_edge.convert")
        say = (lambda m: print(f"[convert] {m}", file=sys.stderr, flush=True)) if progress else log.info
        if outdated:  # our own cached copy, made by an older fate-edge: replaced whole (store_options forces)
            say(f"{out}: cached by an older fate-edge (no int4 block order recorded); converting {model_dir} again")
        else:
            say(f"first use of {model_dir}: converting it once into an expert store ({out})")
        lines = ProgressLines(str(model_dir), None if progress and sys.stderr.isatty() else say, status=status)
        if gguf:  # the streamed precision is the file's own where its blocks fit (q8_0 -> int8)
            convert_gguf(found, out, opts, progress=progress, on_progress=lines)
        else:
            convert(found, out, opts, progress=progress, on_progress=lines)
        # the run goes on in this process: the heap pages conversion freed go back to the kernel, not into its peak
        release_freed_memory()
    return out
