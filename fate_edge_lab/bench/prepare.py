"""Preparation: the model and its store (built once in the work dir), the prompts, and the page cache."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from fate_edge.corpus import heldout_source
from fate_edge.format.work_dirs import make_work_dir, replace_dir
from fate_edge_lab.bench.config import BenchConfig
from fate_edge_lab.synthetic.inflate import inflate, inflated_size


def default_work_dir() -> Path:
    from fate_edge.format.converted_stores import cache_root

    return cache_root().parent / "bench"


def _fingerprint(model_dir: Path, extra: str) -> str:
    h = hashlib.sha256(str(model_dir.resolve()).encode() + extra.encode())
    for f in sorted(model_dir.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


def _convert_once(model_dir: Path, out: Path, layout: str = "auto") -> Path:
    from fate_edge.format.convert import ConvertOptions, convert
    from fate_edge.format.store import is_store

    if layout != "auto":
        out = out.with_name(f"{out.name}-{layout}")
    if not is_store(out):
        # the baselines' store: bf16 experts and float resident weights kept (load-on-demand reads bf16, and the runs
        # quantize resident weights at load as each asks); the default store holds neither (ConvertOptions)
        print(
            f"bench: converting {model_dir} -> {out} (int4 + int2 cold copy + bf16 for the baselines, float resident)",
            flush=True,
        )
        convert(model_dir, out, ConvertOptions.full(bits=4, cold_bits=2, layout=layout), progress=False)
        # Flush the new files to disk now, so their writeback does not take CPU from the first measurements.
        os.sync()
    return out


def prepare_model(cfg: BenchConfig) -> tuple[Path, Path | None, str]:
    """(store, Hugging Face checkpoint or None, description). Built once and reused from the work dir."""
    from fate_edge.bundled import bundled_model_dir
    from fate_edge.format.store import is_store

    work = Path(cfg.work_dir) if cfg.work_dir else default_work_dir()
    if cfg.model:
        src = Path(cfg.model)
        if is_store(src):
            return src, None, f"store {src}"
        store = _convert_once(src, work / f"{src.name}-store-{_fingerprint(src, 'store')}", cfg.layout)
        return store, src, f"{src}"
    bundled = bundled_model_dir()
    hidden = json.loads((bundled / "config.json").read_text())["hidden_size"]
    inter = inflated_size(hidden, cfg.int4_expert_mb)
    tag = _fingerprint(bundled, f"inflate-{inter}")
    model_dir = work / f"tiny-moe-inflated-{inter}-{tag}"
    if not (model_dir / "config.json").exists():
        print(f"bench: inflating the bundled model to expert intermediate size {inter} -> {model_dir}", flush=True)
        tmp = make_work_dir(model_dir)
        inflate(bundled, tmp, inter)
        replace_dir(tmp, model_dir)
    store = _convert_once(model_dir, work / f"{model_dir.name}-store", cfg.layout)
    return store, model_dir, f"bundled tiny-moe inflated to expert intermediate size {inter} (inert units)"


def store_info(store: Path) -> dict[str, Any]:
    from fate_edge.format.store import ExpertStore
    from fate_edge.model.arch import load_config

    s = ExpertStore(store)
    cfg = load_config(store)
    n = len(s.index["moe_layers"]) * s.index["num_experts"]
    return {
        "path": str(store),
        "moe_layers": len(s.index["moe_layers"]),
        "num_experts": s.index["num_experts"],
        "experts_per_token": cfg.num_experts_per_tok,
        "hidden_size": s.index["hidden_size"],
        "moe_intermediate_size": s.index["moe_intermediate_size"],
        "expert_bytes": {str(b): s.expert_bytes(b) for b in s.bits_available},
        "int4_expert_bytes_total": n * s.expert_bytes(4),
        "resident_bytes": (store / "resident.safetensors").stat().st_size,
    }


def make_prompts(store: Path, lengths: list[int]) -> tuple[dict[int, list[int]], list[str]]:
    from fate_edge.tokenizer import Tokenizer

    tok = Tokenizer(store)
    need = max(lengths)
    chars = need * 8
    while True:
        text, files = heldout_source(chars)
        ids = tok.encode(text)
        if len(ids) >= need or chars > need * 64:
            break
        chars *= 2
    while len(ids) < need:  # tiny stdlib: repeat the text
        ids = ids + ids
    return {n: ids[:n] for n in lengths}, files


def drop_page_cache() -> tuple[bool, str]:
    """sync + echo 3 > /proc/sys/vm/drop_caches; (worked, note)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True, "page cache dropped (echo 3 > /proc/sys/vm/drop_caches)"
    except OSError as exc:
        return False, f"could not drop the page cache ({exc.strerror or exc}); reads may hit it"


def warm_page_cache(store: Path) -> None:
    """Read the expert files once so emulated links measure the link, not this machine's disk."""
    for f in sorted(store.glob("experts-*.bin")):
        with open(f, "rb") as fh:
            while fh.read(16 << 20):
                pass
