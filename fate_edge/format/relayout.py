"""Re-lay out a store's int4 experts from torch's CPU kernel layout to the portable one (which fate-edge's own
int4 kernel computes on directly), without the checkpoint: the codes, scales and zeros are the same numbers,
only their order and the zero's convention change, so the model's outputs are what the kernels make of them.

    fate-edge relayout STORE OUT
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from fate_edge.errors import FateEdgeError
from fate_edge.format.checksum import crc32
from fate_edge.format.direct_write import DirectFile
from fate_edge.format.store import BIASES, MATRICES, STORE_FILE, ExpertStore, Precision, plan_parts
from fate_edge.format.work_dirs import make_work_dir, replace_dir
from fate_edge.quant.linear import unpack_int4_cpu
from fate_edge.quant.pack import pack


def _portable_parts(blob: torch.Tensor, old: Precision, new: Precision) -> torch.Tensor:
    """One expert's blob in ``old`` (cpu-int4) → the same expert's blob in ``new`` (portable)."""
    spec = old.spec
    assert spec is not None
    src = {p.name: blob[p.offset : p.offset + p.nbytes] for p in old.parts}
    out = torch.zeros(new.blob_bytes, dtype=torch.uint8)
    shift = 8 - (spec.qmax + 1) // 2  # the cpu-int4 layout centres narrower codes in the 4-bit slot
    for m in MATRICES:
        shape = next(p.shape for p in old.parts if p.name == f"{m}.packed")
        packed = src[f"{m}.packed"].view(shape)
        sz = src[f"{m}.scale_zero"].view(torch.bfloat16).view(-1, shape[0], 2).float()  # [K/g, N, 2]
        scale = sz[..., 0].T
        codes = unpack_int4_cpu(packed, old.block_rows)  # in the order the converting CPU packed
        zero = sz[..., 1].T - (8 - shift) * scale  # zero' = zero + (8 - shift) * scale
        if shift:
            codes = codes - shift
        values = {
            f"{m}.codes": pack(codes, spec.storage_bits),
            f"{m}.scale": scale.to(torch.float16),
            f"{m}.zero": zero.to(torch.float16),
        }
        for p in new.parts:
            if p.name in values:
                out[p.offset : p.offset + p.nbytes] = values[p.name].contiguous().view(torch.uint8).reshape(-1)
    for p in new.parts:
        if p.name in BIASES:  # gpt-oss's float32 biases: the same bytes
            out[p.offset : p.offset + p.nbytes] = src[p.name]
    return out


def relayout_store(src: str | Path, dst: str | Path, progress: bool = True) -> Path:
    """Write store ``src`` to ``dst`` with every cpu-int4 precision in the portable layout; other precisions and
    the resident weights are copied. ``dst`` appears only when complete (written beside it, then renamed)."""
    store = ExpertStore(src)
    src, dst = Path(src), Path(dst)
    if dst.exists():
        raise FateEdgeError(f"{dst}: already exists; choose another directory or remove it")
    todo = {b: p for b, p in store.precisions.items() if p.layout == "cpu-int4"}
    if not todo:
        raise FateEdgeError(f"{src}: has no cpu-int4 experts; it is already portable")
    index = json.loads((src / STORE_FILE).read_text())
    tmp = make_work_dir(dst)
    try:
        for f in src.iterdir():  # resident weights, config, tokenizer, predictors, other precisions
            if f.name == STORE_FILE or f.name in {p.file for p in todo.values()}:
                continue
            (shutil.copytree if f.is_dir() else shutil.copy2)(f, tmp / f.name)
        for bits, old in todo.items():
            bias = any(p.name in BIASES for p in old.parts)  # gpt-oss's expert biases travel as they are
            h, inter = index["hidden_size"], index["moe_intermediate_size"]
            parts, nbytes = plan_parts(bits, old.spec, h, inter, "portable", bias=bias)
            new = replace(old, blob_bytes=nbytes, parts=parts, layout="portable", scale_dtype="float16", block_rows=0)
            refs = sorted((r for r in store.refs.values() if r.bits == bits), key=lambda r: r.offset)
            out = DirectFile(tmp / new.file, new.slot_bytes)
            entries, t0 = [], time.perf_counter()
            try:
                with open(src / old.file, "rb") as blobs:
                    for slot, r in enumerate(refs):
                        blobs.seek(r.offset)
                        data = blobs.read(r.length)
                        if crc32(data) != r.crc32:
                            raise FateEdgeError(
                                f"{src / old.file}: layer {r.layer} expert {r.expert} fails its "
                                "CRC; the store is damaged, re-run fate-edge convert"
                            )
                        blob = _portable_parts(torch.frombuffer(bytearray(data), dtype=torch.uint8), old, new)
                        view = blob.numpy().data
                        out.pwrite_at(view, slot * new.slot_bytes)
                        entries.append(
                            {
                                "layer": r.layer,
                                "expert": r.expert,
                                "offset": slot * new.slot_bytes,
                                "length": new.blob_bytes,
                                "crc32": crc32(view),
                            }
                        )
                        if progress and (slot % 64 == 63 or slot == len(refs) - 1):
                            rate = (slot + 1) * r.length / (time.perf_counter() - t0) / 1e9
                            print(
                                f"\rint{bits}: {slot + 1}/{len(refs)} experts, {rate:.2f} GB/s",
                                end="",
                                file=sys.stderr,
                                flush=True,
                            )
                out.truncate(len(refs) * new.slot_bytes)
            finally:
                out.close()
            if progress:
                print(file=sys.stderr)
            index["precisions"][str(bits)] = new.to_json()
            index["experts"][str(bits)] = entries
        (tmp / STORE_FILE).write_text(json.dumps(index))
        replace_dir(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst
