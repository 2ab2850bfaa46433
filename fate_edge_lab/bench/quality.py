"""Quality of quantized experts: held-out perplexity and greedy-token agreement with the bf16 experts.

Every routed expert is quantized in memory (``quant.methods.quantize_with``: RTN or HQQ) and the model runs
through ``fate_edge.load_model(model, experts=<InMemoryExpertProvider>)``, so the forward pass is the
runtime's own; only the experts change. Configurations, each for RTN and HQQ:

* ``bf16``: the experts as trained (the reference; the rest of the model is fp32 in every run);
* ``int8`` / ``int4`` / ``int3`` (group 64) and ``int2`` (group 32, as Fate ships its cold copies);
* ``int4 + int2 tail``: per layer, the least-used experts (by routing counts of the bf16 model on
  calibration text from the *training* split) are served in int2 so that ~30% of expert uses fall on
  them, the rest in int4 -- Fate's cold tail, decided statically. Layers are filled in order, each
  aiming at the share still missing overall, so the total lands near the target even though a layer
  moves in whole experts. The share achieved on the held-out text is reported.

Experts compute as the runtime computes them (``--compute kernel``: ``QuantizedLinear``, i.e. torch's int4
kernel with bf16 activations for <= 4 bits, dequantize + fp32 matmul for int8) or all dequantized to fp32
(``--compute dequant``, isolating the quantization error from the kernel's bf16 rounding).

Metrics: perplexity of next-token prediction on held-out text (the stdlib files
the bundled model's training run held out, ``fate_edge.corpus``; or, for any model, ``--text FILE``: the file's
first part chooses the int2 tail, the rest is scored), in ``--seq-len`` windows up to ``--tokens`` tokens;
agreement = share of positions whose greedy (argmax) next token equals the bf16 run's, teacher-forced on that text.

    fate-edge eval-quality --tokens 16384 --json bench-out/quality.json --results
    fate-edge eval-quality --model MODEL --text heldout.txt --json bench-out/quality-model.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from fate_edge.quant import Quantized, QuantSpec, bytes_per_weight, dequantize
from fate_edge.quant.linear import QuantizedLinear
from fate_edge.quant.methods import METHODS, quantize_with

from fate_edge.apps.command_line import command_parser, existing_path_as_path, model_path_as_path, positive_int, share
from fate_edge.bundled import bundled_model_dir
from fate_edge.corpus import CorpusSplit, read_corpus
from fate_edge.format.checkpoint import CheckpointReader
from fate_edge.format.checkpoint_experts import ExpertLayout
from fate_edge.format.checkpoint_experts import read_experts as read_layouts
from fate_edge.format.checkpoint_layout import layer_names
from fate_edge.model.arch import load_config
from fate_edge.model.experts import ExpertWeights, InMemoryExpertProvider, QuantizedExpert
from fate_edge.model.transformer import MoETransformer
from fate_edge.planning.calibrate import read_texts
from fate_edge.runtime.loader import load_model
from fate_edge.tokenizer import Tokenizer
from fate_edge_lab.bench.publish import add_results_arg, publish

GROUPS = {8: 64, 4: 64, 3: 64, 2: 32}  # int2 at group 32 like Fate's cold copies; the rest at the store's 64
TAIL_LABEL = "int4 + int2 tail"


# ------------------------------------------------------------------------------------------------ data
def add_eval_args(ap: argparse.ArgumentParser, json_default: str) -> None:
    """The options every held-out quality measurement shares (model, token count, windows, batch, threads, output)."""
    ap.add_argument("--model", type=model_path_as_path, default=bundled_model_dir())
    ap.add_argument("--tokens", type=positive_int, default=8192)
    ap.add_argument("--seq-len", type=positive_int, default=256)
    ap.add_argument("--batch", type=positive_int, default=8)
    ap.add_argument("--threads", type=positive_int, default=1)
    ap.add_argument("--json", type=Path, default=Path(json_default))


def heldout_windows(args: argparse.Namespace) -> torch.Tensor:
    """The held-out text of ``args.model`` as ``args.tokens`` ids in windows of ``args.seq_len`` (add_eval_args)."""
    _, heldout = corpus_split(args.model)
    return windows(encode_texts(Tokenizer(args.model), heldout, args.tokens), args.seq_len)


def corpus_split(model_dir: Path) -> tuple[list[str], list[str]]:
    """(train, held-out) stdlib texts, split by the rule (and the settings) the model was trained with."""
    return read_corpus(CorpusSplit.of_model(model_dir))


def encode_texts(tok: Tokenizer, texts: list[str], max_tokens: int) -> torch.Tensor:
    """Texts joined by end-of-text, as the training script encodes them, up to ``max_tokens``."""
    eos = tok.token_to_id("<|endoftext|>")
    if eos is None:
        eos = min(tok.eos_token_ids) if tok.eos_token_ids else 0
    ids: list[int] = []
    for text in texts:
        if len(ids) >= max_tokens:
            break
        ids.extend(tok.encode(text, add_special_tokens=False))
        ids.append(eos)
    return torch.tensor(ids[:max_tokens], dtype=torch.long)


def windows(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"need at least {seq_len} tokens, got {len(ids)}")
    return ids[: n * seq_len].view(n, seq_len)


# --------------------------------------------------------------------------------------------- experts
def read_experts(model_dir: Path) -> dict[tuple[int, int], ExpertWeights]:
    """Every routed expert in fp32 (exact for a bf16 checkpoint)."""
    cfg = load_config(model_dir)
    reader = CheckpointReader(model_dir)
    names = layer_names(cfg, reader)
    layouts = {i: ExpertLayout(reader, names[i].mlp) for i in cfg.moe_layers}
    out = {}
    for key, w in read_layouts(layouts, cfg.num_experts, torch.float32).experts.items():
        assert isinstance(w, ExpertWeights)  # read in float32: none is quantized
        out[key] = w
    return out


def spec_for(bits: int, dims: tuple[int, ...]) -> QuantSpec:
    """The group size used for ``bits`` (GROUPS), or the largest smaller one dividing every expert dimension."""
    for g in (128, 64, 32):
        if g <= GROUPS[bits] and all(d % g == 0 for d in dims):
            return QuantSpec(bits, g)
    raise ValueError(f"expert dimensions {dims} are not multiples of 32; cannot group-quantize them")


def quantize_layer(experts: dict[int, ExpertWeights], spec: QuantSpec, method: str, compute: str) -> dict[int, object]:
    """Quantize one layer's experts (each matrix kind stacked, so one call covers the layer) → callable experts."""
    ids = sorted(experts)
    per_matrix = []
    for m in ("gate", "up", "down"):
        q = quantize_with(method, torch.stack([getattr(experts[e], m) for e in ids]), spec)  # [E, N, K]
        per_matrix.append(
            [Quantized(q.codes[i], q.scale[i], None if q.zero is None else q.zero[i]) for i in range(len(ids))]
        )
    out: dict[int, object] = {}
    for i, e in enumerate(ids):
        qs = [per_matrix[j][i] for j in range(3)]
        if compute == "dequant":
            out[e] = ExpertWeights(*(dequantize(q, spec) for q in qs))
        else:
            out[e] = QuantizedExpert(*(QuantizedLinear.from_quantized(q, spec) for q in qs))
    return out


# ---------------------------------------------------------------------------------------------- tail
def choose_tail(counts: dict[int, torch.Tensor], share: float) -> dict[int, list[int]]:
    """Per layer, the least-used experts whose uses bring the running total closest to ``share`` of all uses."""
    tail: dict[int, list[int]] = {}
    seen = in_tail = 0.0
    for layer in sorted(counts):
        c = counts[layer].double()
        seen += float(c.sum())
        want = share * seen - in_tail  # uses this layer's tail should take
        order = torch.argsort(c, stable=True).tolist()
        best_k, best_gap, acc = 0, abs(want), 0.0
        for k, e in enumerate(order[:-1], start=1):  # never the whole layer
            acc += float(c[e])
            if abs(acc - want) < best_gap:
                best_k, best_gap = k, abs(acc - want)
            if acc > want:
                break
        tail[layer] = sorted(order[:best_k])
        in_tail += float(c[order[:best_k]].sum())
    return tail


def tail_share(counts: dict[int, torch.Tensor], tail: dict[int, list[int]]) -> float:
    total = sum(float(c.sum()) for c in counts.values())
    return sum(float(counts[layer][tail[layer]].sum()) for layer in tail) / max(total, 1.0)


class RoutingCounter:
    """A ``model.observers`` entry counting expert uses per layer."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.counts: dict[int, torch.Tensor] = {}

    def __call__(self, layer: int, h: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> None:
        c = torch.bincount(idx.flatten(), minlength=self.num_experts)
        self.counts[layer] = self.counts.get(layer, torch.zeros_like(c)) + c


# ------------------------------------------------------------------------------------------------ runs
@torch.inference_mode()
def run(model, seqs: torch.Tensor, batch: int, ref_argmax: torch.Tensor | None = None) -> dict:
    """NLL, perplexity and argmax per position over ``seqs`` [S, T] (teacher-forced, fresh cache per batch)."""
    nll, n_pred, argmax = 0.0, 0, []
    for i in range(0, len(seqs), batch):
        x = seqs[i : i + batch]
        logits = model(x, model.new_cache()).float()  # [B, T, V]
        losses = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="none")
        nll += float(losses.double().sum())  # fp64: an fp32 sum's ulp would hide the differences measured here
        n_pred += x[:, 1:].numel()
        argmax.append(logits.argmax(dim=-1))
    am = torch.cat(argmax)
    out = {"nll": nll / n_pred, "ppl": math.exp(nll / n_pred), "argmax": am}
    if ref_argmax is not None:
        out["agreement"] = float((am == ref_argmax).float().mean())
    return out


def evaluate(
    model_dir: str | Path,
    eval_ids: torch.Tensor,
    calib_ids: torch.Tensor,
    seq_len: int = 256,
    batch: int = 8,
    methods: tuple[str, ...] = METHODS,
    bits: tuple[int, ...] = (8, 4, 3, 2),
    cold_share: float = 0.30,
    compute: str = "kernel",
    log: Callable[[str], None] = print,
) -> dict:
    """Perplexity and agreement for bf16 experts and every (precision, method); see the module docstring."""
    model_dir = Path(model_dir)
    cfg = load_config(model_dir)
    dims = (cfg.hidden_size, cfg.moe_intermediate_size)
    seqs, calib = windows(eval_ids, seq_len), windows(calib_ids, seq_len)
    experts = read_experts(model_dir)

    def load(provider_experts: dict) -> MoETransformer:
        return load_model(model_dir, dtype=torch.float32, experts=InMemoryExpertProvider(provider_experts))

    t0 = time.perf_counter()
    ref_model = load(experts)
    counter = RoutingCounter(cfg.num_experts)
    ref_model.observers.append(counter)
    run(ref_model, calib, batch)
    calib_counts = counter.counts
    counter.counts = {}
    ref = run(ref_model, seqs, batch)
    eval_counts = counter.counts
    tail = choose_tail(calib_counts, cold_share)
    again = run(load(experts), seqs, batch, ref["argmax"])  # a fresh load must reproduce the reference exactly
    rows = [
        {
            "experts": "bf16",
            "method": "-",
            "bits_per_weight": 16.0,
            "ppl": again["ppl"],
            "nll": again["nll"],
            "agreement": again["agreement"],
            "seconds": (time.perf_counter() - t0) / 3,
        }
    ]
    log(json.dumps(rows[-1]))

    hot_spec, cold_spec = spec_for(4, dims), spec_for(2, dims)
    n_tail = sum(len(v) for v in tail.values())
    n_experts = len(experts)
    configs = [(f"int{b}", {key: spec_for(b, dims) for key in experts}) for b in bits]
    configs.append((TAIL_LABEL, {key: cold_spec if key[1] in tail.get(key[0], ()) else hot_spec for key in experts}))
    by_layer: dict[int, dict[int, ExpertWeights]] = {}
    for (layer, e), w in experts.items():
        by_layer.setdefault(layer, {})[e] = w
    for method in methods:
        cache: dict[tuple[int, QuantSpec], dict[int, object]] = {}  # (layer, spec) → every expert of the layer
        for label, specs in configs:
            t0 = time.perf_counter()
            quantized = {}
            for (layer, e), spec in specs.items():
                if (layer, spec) not in cache:
                    cache[(layer, spec)] = quantize_layer(by_layer[layer], spec, method, compute)
                quantized[(layer, e)] = cache[(layer, spec)][e]
            model = load(quantized)
            counter = RoutingCounter(cfg.num_experts)
            model.observers.append(counter)
            res = run(model, seqs, batch, ref["argmax"])
            row = {
                "experts": label,
                "method": method,
                "ppl": res["ppl"],
                "nll": res["nll"],
                "agreement": res["agreement"],
                "seconds": time.perf_counter() - t0,
            }
            if label == TAIL_LABEL:
                hot_bpw, cold_bpw = 8 * bytes_per_weight(hot_spec), 8 * bytes_per_weight(cold_spec)
                share = tail_share(counter.counts, tail)
                row.update(
                    tail_share=share,
                    bits_per_weight=hot_bpw + (cold_bpw - hot_bpw) * share,
                    memory_bits_per_weight=hot_bpw + (cold_bpw - hot_bpw) * n_tail / n_experts,
                )
            else:
                row["bits_per_weight"] = 8 * bytes_per_weight(next(iter(specs.values())))
            rows.append(row)
            log(json.dumps(row))
    return {
        "model": str(model_dir),
        "eval_tokens": seqs.numel(),
        "seq_len": seq_len,
        "calib_tokens": calib.numel(),
        "compute": compute,
        "cold_share_target": cold_share,
        "tail": {
            "experts": {str(k): v for k, v in tail.items()},
            "experts_in_tail": n_tail,
            "experts_total": n_experts,
            "calib_share": tail_share(calib_counts, tail),
            "eval_share_bf16_routing": tail_share(eval_counts, tail),
            "hot": str(hot_spec),
            "cold": str(cold_spec),
        },
        "rows": rows,
    }


# ---------------------------------------------------------------------------------------------- report
def render(result: dict) -> str:
    rows = result["rows"]
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    labels = list(dict.fromkeys(r["experts"] for r in rows))
    by = {(r["experts"], r["method"]): r for r in rows}
    tail = result["tail"]
    lines = [
        f"{Path(result['model']).name}: {result['eval_tokens']} held-out tokens"
        + (f" of `{Path(result['text']['source']).name}`" if result.get("text") else "")
        + f" in windows of {result['seq_len']}; "
        f"experts compute via `{result['compute']}`; everything else fp32. Agreement = share of positions whose "
        "greedy next token matches the bf16 experts' (`fate-edge eval-quality`).",
        "",
        "| experts | bits/weight | "
        + " | ".join(f"ppl {m.upper()}" for m in methods)
        + " | "
        + " | ".join(f"agreement {m.upper()}" for m in methods)
        + " |",
        "|---|---:|" + "---:|" * (2 * len(methods)),
    ]
    for label in labels:
        cells = [by[(label, m)] if (label, m) in by else by[(label, "-")] for m in methods]  # "-": one for all
        bpw = cells[0]["bits_per_weight"]
        lines.append(
            f"| {label} | {bpw:.2f} | "
            + " | ".join(f"{c['ppl']:.2f}" for c in cells)
            + " | "
            + " | ".join(f"{c['agreement']:.1%}" for c in cells)
            + " |"
        )
    shares = ", ".join(f"{m.upper()} {by[(TAIL_LABEL, m)]['tail_share']:.1%}" for m in methods if (TAIL_LABEL, m) in by)
    lines += [
        "",
        f"Tail: {tail['experts_in_tail']} of {tail['experts_total']} experts ({tail['cold']}, the rest "
        f"{tail['hot']}) chosen on {result['calib_tokens']} training-split tokens to take "
        f"{result['cold_share_target']:.0%} of uses (there: {tail['calib_share']:.1%}); share of uses served "
        f"in int2 on the held-out text: {shares}. Bits/weight of the tail row are per use (bytes moved); "
        "held in memory: "
        + ", ".join(f"{by[(TAIL_LABEL, m)]['memory_bits_per_weight']:.2f}" for m in methods[:1])
        + ".",
    ]
    return "\n".join(lines)


def text_split(
    tok: Tokenizer, path: Path, tokens: int, calib_tokens: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(held-out ids, calibration ids, where they came from) of the text in ``path`` (a file, or a directory's
    .txt/.py/.md files): the calibration part comes first (at most half of it), the held-out part after it."""
    texts = read_texts(path, 64 * (tokens + calib_tokens))
    ids = encode_texts(tok, texts, tokens + calib_tokens)
    n_calib = min(calib_tokens, len(ids) // 2)
    calib, held = ids[:n_calib], ids[n_calib : n_calib + tokens]
    if min(len(calib), len(held)) < seq_len:
        raise SystemExit(
            f"{path}: {len(ids)} tokens, fewer than two windows of --seq-len {seq_len} (one to choose "
            "the int2 tail, one to score); pass more text or a smaller --seq-len"
        )
    return (
        held,
        calib,
        {
            "source": str(path),
            "tokens": len(ids),
            "split": f"first {n_calib} tokens choose the int2 tail, the next {len(held)} are scored",
        },
    )


def build_parser() -> argparse.ArgumentParser:
    ap = command_parser("eval-quality", __doc__)
    ap.add_argument(
        "--model",
        type=model_path_as_path,
        default=bundled_model_dir(),
        help="Hugging Face model directory (default: the bundled model)",
    )
    ap.add_argument(
        "--text",
        type=existing_path_as_path,
        default=None,
        help="score the model on this text (file, or directory of .txt/.py/.md) instead of the bundled "
        "model's held-out stdlib files: its first part (--calib-tokens, at most half) chooses the "
        "int2 tail, the rest (up to --tokens) is scored",
    )
    ap.add_argument("--tokens", type=positive_int, default=16384, help="held-out token budget")
    ap.add_argument("--seq-len", type=positive_int, default=256)
    ap.add_argument("--batch", type=positive_int, default=8, help="windows per forward pass")
    ap.add_argument(
        "--calib-tokens", type=positive_int, default=4096, help="training-split tokens to pick the int2 tail"
    )
    ap.add_argument("--cold-share", type=share, default=0.30, help="share of expert uses served in int2")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--compute", choices=("kernel", "dequant"), default="kernel")
    ap.add_argument(
        "--threads", type=positive_int, default=1, help="torch threads (1: steady timings on a shared host)"
    )
    ap.add_argument("--json", type=Path, default=Path("bench-out/quality.json"))
    ap.add_argument(
        "--defaults",
        action="store_true",
        help="instead: the default store (quantized resident weights) and compute dtype beside the old ones, on "
        "real stores (fate_edge_lab/bench/default_quality.py; its own options: eval-quality --defaults --help)",
    )
    add_results_arg(
        ap, "rewrite the table between the eval_quality markers of FILE (without FILE: docs/results/eval_quality.md)"
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    measure(build_parser().parse_args(list(sys.argv[1:] if argv is None else argv)))
    return 0


def measure(args: argparse.Namespace) -> dict:
    """The evaluation ``main`` runs, on its parsed arguments: the result it writes as JSON (and its table)."""
    torch.set_num_threads(args.threads)

    tok = Tokenizer(args.model)
    text = None
    if args.text is not None:
        eval_ids, calib_ids, text = text_split(tok, args.text, args.tokens, args.calib_tokens, args.seq_len)
    else:
        train, heldout = corpus_split(args.model)
        eval_ids = encode_texts(tok, heldout, args.tokens)
        rng = random.Random(0)
        calib_ids = encode_texts(tok, rng.sample(train, min(len(train), 200)), args.calib_tokens)
    if len(eval_ids) < args.tokens:
        print(f"note: the held-out text has only {len(eval_ids)} tokens (asked for {args.tokens})")
    result = evaluate(
        args.model,
        eval_ids,
        calib_ids,
        args.seq_len,
        args.batch,
        tuple(args.methods),
        cold_share=args.cold_share,
        compute=args.compute,
    )
    result["text"] = text
    result["threads"] = args.threads
    result["torch"] = torch.__version__
    publish(result, args.json, render(result), args.results, "eval_quality")
    return result
