"""``fate-edge eval-quality --defaults``: the quality of the default store and compute dtype beside the old ones.

The store convert writes by default quantizes the resident linears and the embedding table (``ConvertOptions``), and
the engine computes in the dtype the hardware runs natively (``runtime.compute_dtype``). This measures what that
costs: every configuration below is a real store (the experts converted once, int4; each configuration's
``resident.safetensors`` written from the float one as convert writes it), loaded by ``load_model`` with its experts
streamed from the store, scored on held-out text. Reference: the old default (float resident weights, float32
compute); agreement = the share of positions whose greedy next token equals the reference's, teacher-forced.

    fate-edge eval-quality --defaults --results
    fate-edge eval-quality --defaults --model /tmp/qwen-2l --text docs --tokens 1024 --seq-len 256 --batch 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from fate_edge.apps.command_line import command_parser, existing_path_as_path, positive_int
from fate_edge.bundled import bundled_model_dir
from fate_edge.format.checkpoint import CheckpointReader
from fate_edge.format.checkpoint_layout import layer_names, resident_weight_names
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.format.prequantized import quantized_resident, write_quantized_resident
from fate_edge.format.store import STORE_FILE
from fate_edge.model.arch import load_config
from fate_edge.runtime.loader import load_model
from fate_edge.tokenizer import Tokenizer
from fate_edge_lab.bench.publish import add_results_arg, publish
from fate_edge_lab.bench.quality import corpus_split, encode_texts, run, text_split, windows


@dataclass(frozen=True)
class Variant:
    label: str
    resident_bits: int | None  # resident linears (None: as in the checkpoint)
    embedding_bits: int | None
    head_bits: int | None  # lm_head (None: resident_bits)
    dtype: str  # compute dtype


OLD = Variant("old default: float resident, float32", None, None, None, "float32")
VARIANTS = (
    OLD,
    Variant("old store, bfloat16", None, None, None, "bfloat16"),
    Variant("int8 resident + int8 embedding, float32", 8, 8, None, "float32"),
    Variant("int4 resident, int8 lm_head, int4 embedding, float32", 4, 4, 8, "float32"),
    Variant("int4 resident, int8 embedding, float32", 4, 8, None, "float32"),
    Variant("int4 resident, int8 lm_head, int8 embedding, float32", 4, 8, 8, "float32"),
    Variant("int4 resident + int4 embedding, float32", 4, 4, None, "float32"),
    Variant("new default: int4 resident, int8 embedding, bfloat16", 4, 8, None, "bfloat16"),
)


def variant_store(base: Path, out: Path, v: Variant) -> Path:
    """``base`` (a store with float resident weights) with its resident part written as convert writes it for
    ``v``; the expert files are hard links (the same experts in every variant)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for f in base.iterdir():
        if f.is_file() and f.name not in ("resident.safetensors", STORE_FILE):
            os.link(f, out / f.name)
        elif f.is_dir():
            shutil.copytree(f, out / f.name)
    cfg = load_config(base)
    reader = CheckpointReader(base)
    names = layer_names(cfg, reader)
    wanted = resident_weight_names(cfg, reader)
    if v.resident_bits is None and v.embedding_bits is None and v.head_bits is None:
        os.link(base / "resident.safetensors", out / "resident.safetensors")
    else:
        head = v.head_bits

        def widths(group: list[str]) -> int | None:
            return head if group == ["lm_head"] else None

        held = quantized_resident(cfg, reader, names, wanted, v.resident_bits, v.embedding_bits, widths)
        write_quantized_resident(out / "resident.safetensors", held)
    index = json.loads((base / STORE_FILE).read_text())
    index.update(resident_bits=v.resident_bits, embedding_bits=v.embedding_bits, head_bits=v.head_bits)
    (out / STORE_FILE).write_text(json.dumps(index, indent=1))
    return out


def store_bytes(store: Path) -> int:
    return sum(f.stat().st_size for f in store.rglob("*") if f.is_file())


def evaluate(model_dir: Path, seqs: torch.Tensor, batch: int, work: Path, log=print) -> dict:
    base = convert(model_dir, work / "base", ConvertOptions(resident_bits=None, embedding_bits=None), progress=False)
    rows, ref = [], None
    for i, v in enumerate(VARIANTS):
        store = variant_store(base, work / f"v{i}", v)
        t0 = time.perf_counter()
        model = load_model(store, dtype=v.dtype)
        res = run(model, seqs, batch, None if ref is None else ref["argmax"])
        close = getattr(model.experts, "close", None)  # a store-backed provider holds open files
        if close is not None:
            close()
        del model
        if ref is None:
            ref = res
        row = {
            "config": v.label,
            "dtype": v.dtype,
            "resident_bits": v.resident_bits,
            "embedding_bits": v.embedding_bits,
            "head_bits": v.head_bits,
            "ppl": res["ppl"],
            "nll": res["nll"],
            "agreement": res.get("agreement", 1.0),
            "resident_mb": (store / "resident.safetensors").stat().st_size / 1e6,
            "store_mb": store_bytes(store) / 1e6,
            "seconds": time.perf_counter() - t0,
        }
        rows.append(row)
        log(json.dumps(row))
        shutil.rmtree(store)
    return {"model": str(model_dir), "eval_tokens": seqs.numel(), "seq_len": seqs.shape[1], "rows": rows}


def render(result: dict) -> str:
    lines = [
        f"Model `{result['model']}`, {result['eval_tokens']} held-out tokens in windows of {result['seq_len']}; "
        "experts int4 from the store in every row; agreement: greedy next token equal to the first row's.",
        "",
        "| configuration | perplexity | agreement | resident MB | store MB |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['config']} | {r['ppl']:.3f} | {100 * r['agreement']:.2f}% | {r['resident_mb']:.1f} | "
            f"{r['store_mb']:.1f} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = command_parser("eval-quality --defaults", __doc__)
    ap.add_argument("--model", type=existing_path_as_path, default=bundled_model_dir())
    ap.add_argument("--text", type=existing_path_as_path, default=None, help="score on this text (file or dir)")
    ap.add_argument("--tokens", type=positive_int, default=8192)
    ap.add_argument("--seq-len", type=positive_int, default=256)
    ap.add_argument("--batch", type=positive_int, default=8)
    ap.add_argument("--threads", type=positive_int, default=1)
    ap.add_argument("--work", type=Path, default=None, help="where the stores are written (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=Path("bench-out/default-quality.json"))
    add_results_arg(ap, "rewrite the table between the default_quality markers of FILE")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    tok = Tokenizer(args.model)
    if args.text is not None:
        ids, _, _ = text_split(tok, args.text, args.tokens, args.seq_len, args.seq_len)
    else:
        ids = encode_texts(tok, corpus_split(args.model)[1], args.tokens)
    seqs = windows(ids, args.seq_len)
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        result = evaluate(args.model, seqs, args.batch, Path(work))
    result["threads"] = args.threads
    publish(result, args.json, render(result), args.results, "default_quality")
    return 0
