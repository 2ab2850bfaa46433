"""``fate-edge calibrate``: record routing on a corpus, train the learned expert predictors, measure them.

1. Run the model over the corpus in windows of ``--seq-len`` tokens and record, per MoE layer, every
   token's gate input and chosen experts (``predictors.evaluate.collect_traces``). The corpus is split
   into training text and held-out text (the last ``--heldout-fraction`` of the windows; for the bundled
   model, or one ``scripts/train_tiny_moe.py`` trained, without ``--corpus``: the stdlib files it was
   trained on / held out, ``fate_edge.corpus``).
2. Save where the engine finds them: the ``predictors/`` of the expert store the engine uses for the model
   (the model itself if it is a store, else its store converted once into the cache; ``--predictors-dir``
   elsewhere; the model's own folder is never written, it may be read-only): ``popularity.json`` (routed
   tokens per layer and expert, to seed caches), ``token-popularity.safetensors`` (the layer-0 token table),
   and the learned predictors ``learned-{linear,lowrank}-p<p>.{json,safetensors}`` with their ONNX graphs.
3. On held-out text, print and write (``<out>/calibration.json``) a per-layer table for every predictor:
   recall at prefetch widths k..k+4, exact top-k match, and the bytes a wrong prefetch reads for nothing.
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fate_edge.corpus import CorpusSplit, read_corpus
from fate_edge.errors import CalibrationError, FateEdgeError
from fate_edge.format.popularity import PREDICTORS_DIR, popularity_json
from fate_edge.planning.gate_similarity import gate_input_similarity, similarity_line


@dataclass
class CalibrateOptions:
    corpus: Path | None = None  # text file or directory of .txt/.py/.md files; None: the stdlib split it was trained on
    lookahead: int = 2  # MoE layers ahead the learned predictors score (1..4)
    tokens: int = 32768  # tokens run through the model, training + held-out
    heldout_fraction: float = 0.1  # share of those tokens kept for the report
    rank: int = 256  # width of the low-rank predictor
    seq_len: int = 256  # tokens per window (each from an empty KV cache)
    batch: int = 4  # windows per forward pass
    epochs: int = 12  # the one-cycle schedule's length (early stopping may end sooner)
    lr: float = 2e-3  # peak AdamW learning rate
    expert_bytes: int | None = None  # bytes one expert moves; default 3·H·I·2 (bf16)
    out: Path | None = None  # calibration.json goes here; default: the predictors directory
    predictors_dir: Path | None = None  # default: predictors/ of the store the engine uses for the model
    onnx: bool = True  # export the learned predictors to ONNX
    progress: bool = True
    seed: int = 0
    previous_input: bool = False  # learned predictors also read the previous token's next-layer gate input
    early_attention: bool = False  # ... and the next layer's attention run early (predictors/early_attention.py)


# ------------------------------------------------------------------------------------------------ corpus
def bundled_split(model_dir: Path) -> tuple[list[str], list[str]]:
    """(training files, held-out files) of the stdlib corpus the bundled model (or ``model_dir``'s, when
    ``scripts/train_tiny_moe.py`` trained it) was trained on."""
    return read_corpus(CorpusSplit.of_model(model_dir))


def trained_on_stdlib(model_dir: Path) -> bool:
    """Whether ``model_dir`` has a default corpus: its ``training_log.json`` (the bundled model's, or one
    ``scripts/train_tiny_moe.py`` wrote) names the stdlib corpus and holds the split settings ``bundled_split``
    reads."""
    try:
        log = json.loads((model_dir / "training_log.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(log, dict) and "standard library" in str(log.get("corpus", "")) and "config" in log


def read_texts(corpus: Path, max_chars: int) -> list[str]:
    """The text of ``corpus`` (a file, or a directory's .txt/.py/.md files in path order), up to ``max_chars``."""
    if corpus.is_dir():
        paths = sorted(p for p in corpus.rglob("*") if p.suffix in (".txt", ".py", ".md") and p.is_file())
    elif corpus.is_file():
        paths = [corpus]
    else:
        raise CalibrationError(f"{corpus}: no such corpus file or directory")
    texts, total = [], 0
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise CalibrationError(f"{path}: cannot read the corpus ({exc})") from exc
        texts.append(text[: max_chars - total])
        total += len(texts[-1])
        if total >= max_chars:
            break
    return texts


def encode_texts(tokenizer: Any, texts: list[str], budget: int, eos: int | None) -> torch.Tensor:
    """Token ids of ``texts`` in order, each followed by ``eos``, stopping after ``budget`` tokens."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer.encode(text, add_special_tokens=False))
        if eos is not None:
            ids.append(eos)
        if len(ids) >= budget:
            break
    return torch.tensor(ids[:budget], dtype=torch.long)


def separator_id(tokenizer: Any, cfg: Any) -> int | None:
    """The token put between corpus texts: ``<|endoftext|>`` if the tokenizer has it, else the model's first eos."""
    eos = tokenizer.token_to_id("<|endoftext|>")
    return eos if eos is not None else (cfg.eos_token_ids[0] if cfg.eos_token_ids else None)


def windows(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    n = len(ids) // seq_len
    return ids[: n * seq_len].view(n, seq_len)


def corpus_windows(
    model_dir: Path, tokenizer: Any, eos: int | None, opts: CalibrateOptions
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """(training windows [n, T], held-out windows [m, T], a description of where they came from)."""
    if not 0 < opts.heldout_fraction < 1:
        raise CalibrationError(f"--heldout-fraction must be in (0, 1), not {opts.heldout_fraction}")
    held_budget = max(opts.seq_len, round(opts.heldout_fraction * opts.tokens))
    train_budget = max(opts.seq_len, opts.tokens - held_budget)
    if opts.corpus is None:
        train_texts, held_texts = bundled_split(model_dir)
        random.Random(opts.seed).shuffle(train_texts)  # the files are in path order: mix packages
        train = windows(encode_texts(tokenizer, train_texts, train_budget, eos), opts.seq_len)
        held = windows(encode_texts(tokenizer, held_texts, held_budget, eos), opts.seq_len)
        desc = {
            "source": "Python stdlib .py files, split as the bundled model was trained (fate_edge.corpus: "
            "training / held-out files)",
            "train_files": len(train_texts),
            "heldout_files": len(held_texts),
        }
    else:
        texts = read_texts(opts.corpus, max(1 << 20, 16 * opts.tokens))
        all_windows = windows(encode_texts(tokenizer, texts, train_budget + held_budget, eos), opts.seq_len)
        if len(all_windows) < 2:
            raise CalibrationError(
                f"{opts.corpus}: gives fewer than 2 windows of {opts.seq_len} tokens; "
                "pass more text or a smaller --seq-len"
            )
        n_held = min(len(all_windows) - 1, max(1, round(opts.heldout_fraction * len(all_windows))))
        train, held = all_windows[:-n_held], all_windows[-n_held:]
        desc = {
            "source": str(opts.corpus),
            "files": len(texts),
            "split": f"last {n_held} of {len(all_windows)} windows held out",
        }
    if len(train) == 0 or len(held) == 0:
        raise CalibrationError(
            f"not enough text for one {opts.seq_len}-token window of training and of held-out "
            "data; raise --tokens or lower --seq-len"
        )
    desc |= {"seq_len": opts.seq_len, "train_tokens": train.numel(), "heldout_tokens": held.numel()}
    return train, held, desc


def trace_windows(model: Any, wins: torch.Tensor, batch: int, desc: str, progress: bool, early: bool = False):
    """The routing of ``wins``; gate inputs (and early-attention inputs) kept in float16, half of float32's memory,
    so a million tokens of a small model fit beside training; the predictors are fitted and scored in float32."""
    from tqdm.auto import tqdm

    from fate_edge.predictors.evaluate import collect_traces

    batches = [wins[s : s + batch] for s in range(0, len(wins), batch)]
    bar = tqdm(batches, desc=desc, unit="batch", disable=not progress, leave=False)
    trace = collect_traces(model, bar, dtype=torch.float16, early=early)
    kept = list(trace.gate_inputs.values()) + list((trace.early_inputs or {}).values())
    if all(bool(torch.isfinite(h).all()) for h in kept):
        return trace
    print(f"calibrate: {desc}: a gate input overflows float16; tracing again in float32", file=sys.stderr)
    del trace, kept  # not held beside the float32 trace
    bar = tqdm(batches, desc=desc, unit="batch", disable=not progress, leave=False)
    return collect_traces(model, bar, dtype=torch.float32, early=early)


def engine_predictors_dir(model_dir: Path, progress: bool = True) -> Path:
    """Where the engine looks for ``model_dir``'s predictors: ``predictors/`` of the store it opens for that
    model (``store_cache.ensure_store``, as ``Engine.load`` does; converted once if not yet done)."""
    from fate_edge.format.converted_stores import ensure_store

    try:
        return ensure_store(model_dir, progress=progress) / PREDICTORS_DIR
    except FateEdgeError as exc:
        raise CalibrationError(
            f"{model_dir}: the engine cannot open this model as an expert store ({exc}), so it "
            "would never load predictors for it; pass --predictors-dir DIR to keep them"
        ) from exc


# ------------------------------------------------------------------------------------------------ report
def rows_json(name: str, results: list[Any]) -> list[dict[str, Any]]:
    return [
        {
            "predictor": name,
            "source": a.source,
            "target": a.target,
            "distance": a.distance,
            "tokens": a.tokens,
            "exact": a.exact,
            "recall": {str(w): r for w, r in a.recall.items()},
            "wasted_bytes": {str(w): b for w, b in a.wasted_bytes.items()},
        }
        for a in results
    ]


def means(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per distance: the mean over source layers of every metric."""
    out = []
    for d in sorted({r["distance"] for r in rows}):
        at = [r for r in rows if r["distance"] == d]
        out.append(
            {"distance": d, "pairs": len(at), "exact": sum(r["exact"] for r in at) / len(at)}
            | {key: {w: sum(r[key][w] for r in at) / len(at) for w in at[0][key]} for key in ("recall", "wasted_bytes")}
        )
    return out


def table_markdown(report: dict[str, Any]) -> str:
    k = report["k"]
    widths = [str(w) for w in report["widths"]]
    waste = [w for w in (str(k), str(k + 2)) if w in widths]
    head = [
        "predictor",
        "layer i → j",
        "exact",
        *(f"recall@{w}" for w in widths),
        *(f"waste KiB/tok @{w}" for w in waste),
    ]
    out = [
        f"Held-out: {report['corpus']['heldout_tokens']:,} tokens; top-{k} of {report['num_experts']} experts; "
        f"{report['bytes_per_expert'] / 1024:.1f} KiB per expert; lookahead {report['lookahead']}.",
        "",
        "| " + " | ".join(head) + " |",
        "|---|---|" + "---:|" * (len(head) - 2),
    ]

    def line(name: str, arrow: str, r: dict[str, Any]) -> str:
        cells = [name, arrow, f"{100 * r['exact']:.1f}%"] + [f"{100 * r['recall'][w]:.1f}%" for w in widths]
        cells += [f"{r['wasted_bytes'][w] / 1024:.1f}" for w in waste]
        return "| " + " | ".join(cells) + " |"

    similarity = similarity_line(report.get("gate_input_similarity", []))
    if similarity:
        out[1:1] = ["", similarity]
    for name, block in report["predictors"].items():
        for r in block["rows"]:
            src = "tok" if r["source"] < 0 else str(r["source"])
            out.append(line(name, f"{src} → {r['target']}" + (f" (+{r['distance']})" if r["distance"] > 1 else ""), r))
        for m in block["mean"]:
            out.append(line(f"**{name}**", f"**mean +{m['distance']}**", m))
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------------- main
def calibrate(model_dir: str | Path, opts: CalibrateOptions | None = None) -> dict[str, Any]:
    """Run the whole calibration (module docstring); returns the report written to calibration.json."""
    from fate_edge.predictors import EMBEDDING, CrossLayerGate, TokenPopularity
    from fate_edge.predictors.evaluate import evaluate_predictor
    from fate_edge.predictors.learned import TrainConfig, train_learned
    from fate_edge.predictors.previous_input import widen_trace
    from fate_edge.runtime.loader import load_model
    from fate_edge.tokenizer import Tokenizer

    opts = opts or CalibrateOptions()
    t0 = time.time()
    model_dir = Path(model_dir)
    if not 1 <= opts.lookahead <= 4:
        raise CalibrationError(f"--lookahead must be 1..4, not {opts.lookahead}")
    if opts.corpus is None and not trained_on_stdlib(model_dir):
        raise CalibrationError(
            "--corpus FILE is required (only the bundled model, and models whose training_log.json "
            "names the Python standard library corpus, have a default corpus: their stdlib split)"
        )
    pred_dir = opts.predictors_dir or engine_predictors_dir(model_dir, opts.progress)  # before hours of tracing
    model = load_model(model_dir, torch.float32)
    cfg = model.config
    if opts.early_attention and cfg.mla is not None:
        raise CalibrationError(
            "--early-attention runs the next layer's GQA attention early; this model's attention "
            "is MLA (DeepSeek), which it does not support: calibrate without it"
        )
    tokenizer = Tokenizer(model_dir)
    train_wins, held_wins, corpus = corpus_windows(model_dir, tokenizer, separator_id(tokenizer, cfg), opts)
    log = print if opts.progress else (lambda *a, **k: None)
    log(
        f"calibrate: {corpus['train_tokens']:,} training and {corpus['heldout_tokens']:,} held-out tokens "
        f"({corpus['source']})",
        file=sys.stderr,
    )

    early = opts.early_attention
    train = trace_windows(model, train_wins, opts.batch, "tracing training text", opts.progress, early)
    held = trace_windows(model, held_wins, opts.batch, "tracing held-out text", opts.progress, early)
    pred_dir.mkdir(parents=True, exist_ok=True)
    files = {"popularity": pred_dir / "popularity.json", "token_popularity": pred_dir / "token-popularity.safetensors"}
    files["popularity"].write_text(json.dumps(popularity_json(train, model_dir), indent=1))

    k, p = cfg.num_experts_per_tok, opts.lookahead
    bytes_per_expert = opts.expert_bytes if opts.expert_bytes is not None else cfg.expert_params * 2
    widths = list(range(k, k + 5))
    predictors: dict[str, Any] = {
        "cross-layer-gate": CrossLayerGate.from_model(model, p),
        "cross-layer-gate-norm": CrossLayerGate.from_model(model, p, norm_variant=True),
    }
    # Start the learned predictors from whichever gate variant predicts better on the validation tail.
    val_fraction = TrainConfig().val_fraction
    val = train.rows(train.tokens - max(1, round(val_fraction * train.tokens)))
    init_scores = {}
    for name in ("cross-layer-gate", "cross-layer-gate-norm"):
        results = evaluate_predictor(predictors[name], val, [k])
        init_scores[name] = sum(a.exact for a in results) / max(1, len(results))
    init = max(init_scores, key=lambda n: (init_scores[n], n == "cross-layer-gate"))
    training: dict[str, Any] = {"init": init, "init_val_exact": init_scores}
    # What the learned predictors read: the gate inputs, beside them the next layer's attention run early and/or
    # the previous token's next-layer gate inputs.
    learned_train, learned_held = train, held
    if opts.previous_input or early:
        learned_train, learned_held = (
            widen_trace(t, cfg.moe_layers, opts.seq_len, opts.previous_input, early) for t in (train, held)
        )
    for kind in ("linear", "lowrank"):
        tc = TrainConfig(
            kind=kind,
            rank=opts.rank,
            epochs=opts.epochs,
            lr=opts.lr,
            seed=opts.seed,
            val_fraction=val_fraction,
            previous_input=opts.previous_input,
            early_attention=early,
        )
        learned = train_learned(predictors[init], learned_train, config=tc, progress=opts.progress)
        predictors[f"learned-{kind}"] = learned
        training[kind] = learned.meta["training"]
    token_pop = TokenPopularity.from_trace(train, cfg.vocab_size, lookahead=1)
    token_pop.save(files["token_popularity"])

    report_preds: dict[str, Any] = {}
    for name, pred in predictors.items():
        rows = rows_json(
            name,
            evaluate_predictor(pred, learned_held if name.startswith("learned") else held, widths, bytes_per_expert),
        )
        report_preds[name] = {"rows": rows, "mean": means(rows)}
    rows = rows_json(
        "token-popularity", evaluate_predictor(token_pop, held, widths, bytes_per_expert, sources=[EMBEDDING])
    )
    report_preds["token-popularity"] = {"rows": rows, "mean": means(rows)}

    for kind in ("linear", "lowrank"):
        learned = predictors[f"learned-{kind}"]
        learned.meta["metrics"]["heldout"] = report_preds[f"learned-{kind}"]["rows"]
        learned.meta["training"]["heldout_tokens"] = held.tokens
        try:
            files[f"learned_{kind}"] = learned.save(pred_dir, onnx=opts.onnx)
        except ImportError as exc:  # an exporter dependency is missing: keep the torch weights
            print(f"calibrate: ONNX export skipped ({exc}); install fate-edge[onnx]", file=sys.stderr)
            files[f"learned_{kind}"] = learned.save(pred_dir, onnx=False)

    report: dict[str, Any] = {
        "model": str(model_dir),
        "generated": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model_type": cfg.model_type,
        "moe_layers": cfg.moe_layers,
        "num_experts": cfg.num_experts,
        "k": k,
        "lookahead": p,
        "widths": widths,
        "bytes_per_expert": bytes_per_expert,
        "previous_input": opts.previous_input,
        "early_attention": early,
        "bytes_per_expert_source": "--expert-bytes" if opts.expert_bytes is not None else "3·H·I·2 (bf16)",
        "corpus": corpus,
        "training": training,
        "predictors": report_preds,
        "gate_input_similarity": gate_input_similarity(held, cfg.moe_layers, p),
        "files": {key: str(path) for key, path in files.items()},
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "seconds": round(time.time() - t0, 1),
    }
    out = opts.out or pred_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration.json").write_text(json.dumps(report, indent=1))
    report["files"]["calibration"] = str(out / "calibration.json")
    return report
