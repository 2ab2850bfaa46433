"""Measure a model directory and write its model card.

On held-out text (the stdlib ``.py`` files the training run held out, selected by ``fate_edge.corpus``'s
``read_corpus``/``is_heldout``), reading a bounded number of tokens, this computes:

* perplexity;
* per MoE layer: expert-usage entropy (/ log E) and the most used expert's share of routed slots;
* per MoE layer: how well Fate's cross-layer gate (WWW'26, arXiv 2502.12224), i.e. layer i+1's router
  applied to layer i's gate input, predicts layer i+1's experts: recall@k, recall@k+2, exact top-k match
  (plus the norm-rescaled variant and lookahead 2-3, from ``predictors.evaluate``).

It writes the numbers as JSON (default ``<model>/model_card.json``), prints them as markdown, and renders
``<model>/README.md`` with the corpus, architecture, training summary (``training_log.json``) and tables.

    fate-edge model-card fate_edge/assets/tiny-moe --tokens 16384

The README's "Reproduce" section lists the training commands ``training_log.json`` records (``commands``).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from fate_edge.bundled import bundled_model_dir
from fate_edge.command_line import command_parser, model_path_as_path, positive_int
from fate_edge.corpus import CorpusSplit, read_corpus
from fate_edge.predictors import CrossLayerGate
from fate_edge.predictors.evaluate import TraceRecorder, evaluate_predictor, usage_stats
from fate_edge.runtime.loader import load_model

LOOKAHEAD = 3  # distances reported in the lookahead summary


def read_training_log(model_dir: Path) -> dict[str, Any] | None:
    path = model_dir / "training_log.json"
    return json.loads(path.read_text()) if path.exists() else None


def heldout_texts(train_config: dict[str, Any] | None) -> list[str]:
    """The held-out files of the training run (same fraction and corpus cap as its config)."""
    return read_corpus(CorpusSplit.from_config(train_config))[1]


def encode(model_dir: Path, texts: list[str], eos_id: int) -> torch.Tensor:
    """Token ids of ``texts``, each followed by end-of-text, as the training script's encode_all does."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    eos = eos_id if eos is None else eos
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def run_model(model: Any, ids: torch.Tensor, seq_len: int, batch: int) -> tuple[float, int, Any]:
    """Mean next-token loss over non-overlapping ``seq_len`` windows of ``ids``, and the routing trace."""
    n_seq = len(ids) // seq_len
    seqs = ids[: n_seq * seq_len].view(n_seq, seq_len)
    rec = TraceRecorder(model.config.num_experts)
    model.observers.append(rec)
    total, count = 0.0, 0
    try:
        for s in range(0, n_seq, batch):
            x = seqs[s : s + batch]
            logits = model(x, model.new_cache())  # [B, T, V]
            total += F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten(), reduction="sum").item()
            count += x[:, 1:].numel()
    finally:
        model.observers.remove(rec)
    return total / max(count, 1), count, rec.trace()


def architecture(model: Any, model_dir: Path) -> dict[str, Any]:
    cfg = model.config
    seen, resident = set(), 0
    for t in model.w.values():  # tied embeddings appear twice
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            resident += t.numel()
    n_moe = len(cfg.moe_layers)
    expert_total = cfg.expert_params * cfg.num_experts * n_moe
    return {
        "model_type": cfg.model_type,
        "layers": cfg.num_hidden_layers,
        "moe_layers": n_moe,
        "hidden_size": cfg.hidden_size,
        "attention_heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads,
        "vocab_size": cfg.vocab_size,
        "experts": cfg.num_experts,
        "experts_per_token": cfg.num_experts_per_tok,
        "expert_intermediate_size": cfg.moe_intermediate_size,
        "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
        "params_total": resident + expert_total,
        "params_routed_experts": expert_total,
        "params_active_per_token": resident + cfg.expert_params * cfg.num_experts_per_tok * n_moe,
        "params_per_expert": cfg.expert_params,
        "checkpoint_bytes": sum(p.stat().st_size for p in model_dir.glob("*.safetensors")),
        "checkpoint_dtype": cfg.torch_dtype,
    }


def cross_layer_tables(model: Any, trace: Any, bytes_per_expert: int) -> dict[str, Any]:
    k = model.config.num_experts_per_tok
    plain = evaluate_predictor(CrossLayerGate.from_model(model, LOOKAHEAD), trace, [k, k + 2], bytes_per_expert)
    normed = evaluate_predictor(CrossLayerGate.from_model(model, 1, norm_variant=True), trace, [k, k + 2])
    normed_by_src = {a.source: a for a in normed}
    rows = []
    for a in (a for a in plain if a.distance == 1):
        n = normed_by_src[a.source]
        rows.append(
            {
                "source": a.source,
                "target": a.target,
                "tokens": a.tokens,
                "recall@k": a.recall[k],
                "recall@k+2": a.recall[min(k + 2, max(a.recall))],
                "exact": a.exact,
                "wasted_bytes_per_token@k+2": a.wasted_bytes[min(k + 2, max(a.recall))],
                "norm_variant_recall@k": n.recall[k],
                "norm_variant_exact": n.exact,
            }
        )
    lookahead = []
    for d in range(1, LOOKAHEAD + 1):
        at_d = [a for a in plain if a.distance == d]
        if at_d:
            lookahead.append(
                {
                    "distance": d,
                    "pairs": len(at_d),
                    "recall@k": sum(a.recall[k] for a in at_d) / len(at_d),
                    "exact": sum(a.exact for a in at_d) / len(at_d),
                }
            )
    keys = [key for key in (rows[0] if rows else {}) if key not in ("source", "target", "tokens")]
    mean = {key: sum(r[key] for r in rows) / len(rows) for key in keys} if rows else {}
    return {"k": k, "bytes_per_expert_bf16": bytes_per_expert, "layers": rows, "mean": mean, "lookahead": lookahead}


def measure(model_dir: Path, tokens: int, seq_len: int, batch: int) -> dict[str, Any]:
    t0 = time.time()
    log = read_training_log(model_dir)
    model = load_model(model_dir, torch.float32)
    texts = heldout_texts((log or {}).get("config"))
    eos = model.config.eos_token_ids[0] if model.config.eos_token_ids else 0
    ids = encode(model_dir, texts, eos)
    loss, count, trace = run_model(model, ids[:tokens], seq_len, batch)
    if count == 0:
        raise SystemExit(f"held-out text gave {len(ids)} tokens, fewer than one window of {seq_len}")
    arch = architecture(model, model_dir)
    return {
        "model": str(model_dir),
        "generated": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "architecture": arch,
        "heldout": {
            "rule": "stdlib .py files with sha1(file name)[:4] / 2**32 < heldout_fraction "
            "(fate_edge.corpus.is_heldout), within the training corpus cap",
            "files": len(texts),
            "tokens_available": len(ids),
            "tokens_scored": count,
            "seq_len": seq_len,
            "loss": loss,
            "ppl": math.exp(loss),
        },
        "usage": [vars(u) for u in usage_stats(trace)],
        "cross_layer_gate": cross_layer_tables(model, trace, arch["params_per_expert"] * 2),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "seconds": round(time.time() - t0, 1),
    }


# ------------------------------------------------------------------------------------------ markdown
def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def results_markdown(card: dict[str, Any]) -> str:
    """The measured sections: held-out perplexity, expert usage, cross-layer prediction."""
    h, c = card["heldout"], card["cross_layer_gate"]
    k = c["k"]
    out = [
        "## Held-out perplexity",
        "",
        f"**{h['ppl']:.2f}** (loss {h['loss']:.4f} nats/token) over {h['tokens_scored']:,} predicted tokens: "
        f"{h['tokens_scored'] // (h['seq_len'] - 1):,} windows of {h['seq_len']} tokens from {h['files']} "
        f"held-out files ({h['tokens_available']:,} tokens available), fp32, this runtime.",
        "",
        "## Expert usage per layer",
        "",
        f"Entropy of the routed-slot distribution / log E (1.0 = perfectly balanced); top share: slots taken by the "
        f"most used expert (balanced: {_pct(1 / card['architecture']['experts'])}).",
        "",
        "| layer | entropy / log E | top expert | top share |",
        "|---:|---:|---:|---:|",
    ]
    for u in card["usage"]:
        out.append(f"| {u['layer']} | {u['entropy']:.3f} | {u['top_expert']} | {_pct(u['top_share'])} |")
    out += [
        "",
        "## Cross-layer gate prediction (Fate)",
        "",
        f"Layer i+1's router applied to layer i's gate input (Fate, WWW'26, arXiv 2502.12224), no training. "
        f"recall@{k}: share of the true top-{k} experts inside the predicted top-{k}; recall@{k + 2}: inside the "
        f"predicted top-{k + 2} (prefetching 2 more); exact: predicted top-{k} set = true set. Norm variant: gate "
        f"input rescaled by norm(i+1)/norm(i) weights. Wasted: bf16 bytes of predicted-but-unused experts per token "
        f"at width {k + 2} ({c['bytes_per_expert_bf16'] / 1024:.0f} KiB per expert).",
        "",
        f"| layer i → i+1 | recall@{k} | recall@{k + 2} | exact | recall@{k} (norm variant) | exact (norm variant) "
        f"| wasted KiB/token @{k + 2} |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in c["layers"] + ([dict(c["mean"], source="mean", target="")] if c["mean"] else []):
        arrow = f"{r['source']} → {r['target']}" if r["target"] != "" else "**mean**"
        out.append(
            f"| {arrow} | {_pct(r['recall@k'])} | {_pct(r['recall@k+2'])} | {_pct(r['exact'])} "
            f"| {_pct(r['norm_variant_recall@k'])} | {_pct(r['norm_variant_exact'])} "
            f"| {r['wasted_bytes_per_token@k+2'] / 1024:.1f} |"
        )
    if c["lookahead"]:
        look = ", ".join(
            f"{la['distance']} layer(s) ahead {_pct(la['recall@k'])} (exact {_pct(la['exact'])})"
            for la in c["lookahead"]
        )
        out += ["", f"Lookahead (stacked gates, mean recall@{k}): {look}."]
    return "\n".join(out) + "\n"


def _loss_curve(log: list[dict[str, Any]]) -> list[str]:
    if not log:
        return ["(no log entries)"]
    picks = sorted({round(f * (len(log) - 1)) for f in (0, 0.1, 0.25, 0.5, 0.75, 1.0)})
    rows = ["| step | tokens | minutes | train loss | aux loss | held-out loss |", "|---:|---:|---:|---:|---:|---:|"]
    for i in picks:
        e = log[i]
        evals = [x for x in log[: i + 1] if "heldout_loss" in x]
        held = f"{evals[-1]['heldout_loss']:.3f} (step {evals[-1]['step']})" if evals else "–"
        rows.append(
            f"| {e['step']} | {e['tokens']:,} | {e['seconds'] / 60:.1f} | {e['loss']:.3f} "
            f"| {e.get('aux_loss', float('nan')):.3f} | {held} |"
        )
    best = min(log, key=lambda x: x["loss"])
    rows += ["", f"Lowest logged train loss {best['loss']:.3f} at step {best['step']}."]
    return rows


def readme_markdown(card: dict[str, Any], log: dict[str, Any] | None) -> str:
    a = card["architecture"]
    name = Path(card["model"]).name
    tcfg = (log or {}).get("config", {})
    entries = [e for e in (log or {}).get("log", []) if "loss" in e]  # drop markers such as resumed_at_step
    last = entries[-1] if entries else {}
    out = [
        f"# {name}",
        "",
        f"A tiny {a['model_type']} (Qwen1.5-MoE style) mixture-of-experts language model bundled with fate-edge "
        "for tests, examples and benchmarks, small enough to ship. It continues Python source code. The tables below "
        "say how skewed its expert routing is and how well the next layer's experts can be predicted.",
        "",
        f"*Generated by `fate-edge model-card` on {card['generated']}; numbers in `model_card.json`.*",
        "",
        "## Corpus",
        "",
        f"- {(log or {}).get('corpus', 'Python standard library .py files')}, read in sorted path order up to "
        f"{tcfg.get('max_corpus_bytes', 0):,} characters.",
        f"- Held-out split: files whose SHA-1 of the file name falls below {tcfg.get('heldout_fraction', '?')} "
        f"({card['heldout']['files']} files, {card['heldout']['tokens_available']:,} tokens); "
        "all other files are training data.",
        f"- Tokenizer: byte-level BPE trained on the training split, vocabulary {a['vocab_size']:,}.",
        "",
        "## Architecture",
        "",
        "| | |",
        "|---|---|",
        f"| layers (MoE) | {a['layers']} ({a['moe_layers']}) |",
        f"| hidden size | {a['hidden_size']} |",
        f"| attention heads / KV heads | {a['attention_heads']} / {a['kv_heads']} |",
        f"| routed experts per layer, top-k | {a['experts']}, top-{a['experts_per_token']} |",
        f"| expert / shared-expert width | {a['expert_intermediate_size']} / {a['shared_expert_intermediate_size']} |",
        f"| parameters total / active per token | {a['params_total'] / 1e6:.2f} M "
        f"/ {a['params_active_per_token'] / 1e6:.2f} M |",
        f"| routed-expert parameters | {a['params_routed_experts'] / 1e6:.2f} M "
        f"({a['params_per_expert']:,} per expert) |",
        f"| checkpoint | {a['checkpoint_bytes'] / 2**20:.1f} MiB safetensors, {a['checkpoint_dtype']} |",
        "",
        "## Training",
        "",
    ]
    if log is None:
        out.append("No `training_log.json` in the model directory.")
    else:
        done = log.get("complete", False)
        steps = log.get("steps", last.get("step", 0))
        toks = log.get("train_tokens", last.get("tokens", 0))
        secs = log.get("train_seconds", last.get("seconds", 0))
        out += [
            ("" if done else "**Intermediate checkpoint** (training had not finished). ")
            + f"{steps:,} steps, {toks:,} tokens, {secs / 60:.1f} minutes on {log.get('threads', '?')} CPU threads "
            f"(batch {tcfg.get('batch_size', '?')} × {tcfg.get('seq_len', '?')} tokens, AdamW, peak lr "
            f"{tcfg.get('lr', '?')}, cosine over the wall-clock budget, load-balancing loss weight "
            f"{tcfg.get('router_aux_loss_coef', '?')}).",
            "",
        ]
        out += _loss_curve(entries)
        if "heldout_ppl" in log:
            out += ["", f"Held-out perplexity measured by the training script at the end: {log['heldout_ppl']:.2f}."]
    out += ["", results_markdown(card).rstrip()]
    out += calibration_markdown(Path(card["model"]) / "predictors" / "calibration.json")
    commands = (log or {}).get("commands") or ["# training_log.json does not record the training commands"]
    model = card["model"]
    out += [
        "",
        "## Reproduce",
        "",
        "```",
        *commands,
        f"fate-edge calibrate {model} --lookahead 2",
        f"fate-edge model-card {model} --tokens {card['heldout']['tokens_scored']}",
        "```",
        "",
    ]
    return "\n".join(out)


def calibration_markdown(path: Path) -> list[str]:
    """Mean per-predictor accuracy from ``fate-edge calibrate``'s calibration.json, if the model has one."""
    if not path.exists():
        return []
    cal = json.loads(path.read_text())
    k = cal["k"]
    out = [
        "",
        "## Calibrated predictors (`fate-edge calibrate`)",
        "",
        f"Trained on {cal['corpus']['train_tokens']:,} tokens of the training split, reported on "
        f"{cal['corpus']['heldout_tokens']:,} held-out tokens; means over layer pairs. Files in `predictors/`.",
        "",
        f"| predictor | layers ahead | exact top-{k} | recall@{k} | recall@{k + 2} |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, res in cal["predictors"].items():
        for m in res["mean"]:
            out.append(
                f"| {name} | {m['distance']} | {_pct(m['exact'])} | {_pct(m['recall'][str(k)])} "
                f"| {_pct(m['recall'][str(k + 2)])} |"
            )
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = command_parser("model-card", __doc__)
    ap.add_argument(
        "model",
        nargs="?",
        type=model_path_as_path,
        default=bundled_model_dir(),
        help="model directory (default: the bundled model)",
    )
    ap.add_argument("--tokens", type=positive_int, default=16384, help="held-out tokens to score (bounded for speed)")
    ap.add_argument("--seq-len", type=positive_int, default=256)
    ap.add_argument("--batch", type=positive_int, default=4, help="windows per forward pass")
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--json", type=Path, default=None, help="default: <model>/model_card.json")
    ap.add_argument("--readme", type=Path, default=None, help="default: <model>/README.md")
    ap.add_argument("--no-readme", action="store_true", help="only write the JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if not (args.model / "config.json").exists():
        ap.error(f"{args.model}: no config.json; pass a model directory")
    torch.set_num_threads(args.threads)
    card = measure(args.model, args.tokens, args.seq_len, args.batch)
    (args.json or args.model / "model_card.json").write_text(json.dumps(card, indent=1))
    if not args.no_readme:
        readme = readme_markdown(card, read_training_log(args.model))
        (args.readme or args.model / "README.md").write_text(readme)
    print(results_markdown(card))
    return 0
