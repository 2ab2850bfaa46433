"""The store writer as it was before the resident part and the experts were written at once: resident.safetensors
first, then each expert's blobs written by the main thread in slot order, a GGUF's experts read one at a time
(``encode_gguf_expert`` reading its own bytes). Kept as the reference the concurrent writer's files are compared
with, byte for byte."""

from __future__ import annotations

import collections
import itertools
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from fate_edge.format.checkpoint import save_streaming
from fate_edge.format.checkpoint_layout import resident_weight_names
from fate_edge.format.checksum import crc32
from fate_edge.format.convert import ConvertOptions, StoreSource, _set_file_modes, store_index
from fate_edge.format.direct_write import DirectFile
from fate_edge.format.store import STORE_FILE, Precision


def sequential_write_store(
    src: StoreSource, out_dir: Path, opts: ConvertOptions, precisions: list[Precision], *_args, **_kwargs
) -> Path:
    """What ``write_store`` wrote before (same signature, so it can stand in for it)."""
    cfg, reader = src.cfg, src.reader
    out_dir.mkdir(parents=True)
    src.write_aux(out_dir)
    names_resident = resident_weight_names(cfg, reader)
    before = torch.get_num_threads()
    if opts.resident_bits is None and opts.embedding_bits is None:
        save_streaming(reader, names_resident, out_dir / "resident.safetensors", {"format": "pt"})
    else:
        from fate_edge.format.prequantized import quantized_resident, write_quantized_resident

        torch.set_num_threads(1)
        held = quantized_resident(cfg, reader, src.names, names_resident, opts.resident_bits, opts.embedding_bits)
        torch.set_num_threads(before)
        write_quantized_resident(out_dir / "resident.safetensors", held)
    jobs = [(layer, e) for layer in cfg.moe_layers for e in range(cfg.num_experts)]
    threads = opts.threads or min(os.cpu_count() or 1, 8)
    entries: dict[str, list[dict]] = {str(p.bits): [] for p in precisions}
    files = {p.bits: DirectFile(out_dir / p.file, p.slot_bytes) for p in precisions}
    torch.set_num_threads(1)
    with ThreadPoolExecutor(threads) as pool:

        def submit(item):
            slot, (layer, e) = item
            return slot, layer, e, pool.submit(src.encode, layer, e, precisions, opts.method)

        ahead = iter(enumerate(jobs))
        pending = collections.deque(map(submit, itertools.islice(ahead, 2 * threads)))
        while pending:
            slot, layer, e, fut = pending.popleft()
            blobs = fut.result()
            pending.extend(map(submit, itertools.islice(ahead, 1)))
            for p, (blob, crc) in zip(precisions, blobs):
                offset = slot * p.slot_bytes
                files[p.bits].pwrite_at(blob, offset)
                entries[str(p.bits)].append(
                    {"layer": layer, "expert": e, "offset": offset, "length": len(blob), "crc32": crc}
                )
    torch.set_num_threads(before)
    for p in precisions:
        files[p.bits].truncate(len(jobs) * p.slot_bytes)
        files[p.bits].close()
    (out_dir / STORE_FILE).write_text(json.dumps(store_index(src, opts, precisions, entries), indent=1))
    _set_file_modes(out_dir)
    return out_dir


def sequential_gguf_write_store(src: StoreSource, out_dir: Path, opts, precisions, *args, **kwargs) -> Path:
    """``sequential_write_store`` for a GGUF source, each expert read by ``encode_gguf_expert`` itself (the read
    path before ``ExpertReads``)."""
    from fate_edge.format.gguf_convert import encode_gguf_expert

    g = src.reader.g

    def encode(layer: int, e: int, precs: list[Precision], method: str):
        return [(b, crc32(b)) for b in encode_gguf_expert(g, layer, e, precs, method)]

    return sequential_write_store(replace(src, encode=encode), out_dir, opts, precisions)
