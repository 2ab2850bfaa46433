"""How much of the learned predictor's miss is information that does not exist yet one layer ahead.

On a model's own text (the bundled model and its stdlib split by default), this trains the low-rank predictor
with `fate-edge calibrate`'s recipe one MoE layer ahead on four inputs and scores each on held-out text:

1. layer i's gate input: what fate-edge's predictor reads (Fate's source), early enough to read ahead;
2. layer i+1's input before its attention: everything but that attention (a later, "pre-attention" source,
   arXiv 2511.10676): an estimate of what any predictor that runs before layer i+1's attention could know.
3. layer i's gate input beside the previous token's layer i+1 gate input: in decode that token's forward is
   finished, so this is causal; it carries what layer i+1's attention saw one position earlier (what
   `fate-edge calibrate --previous-input` trains and the engine runs; fate_edge.predictors.previous_input).
4. layer i's gate input beside layer i+1's attention run early on layer i's residual: causal in decode (the
   earlier tokens' keys and values are in the cache; fate_edge.predictors.early_attention), not run by the engine
   yet.

Layer i+1's own router on its gate input is exact by definition, so the gap between 2. and 100% is what layer
i+1's attention (the context of the other tokens) decides; 3. measures how much of that the previous position
already holds.

``--routers-only`` trains nothing (minutes on a real-shape checkpoint, ``--dtype bfloat16``): it scores every MoE
layer's own router on that layer's input before its attention, normalised by the layer's own post-attention norm
(for the first MoE layer of a model without dense layers: the sampled token's embedding), beside the norm-aware
cross-layer gate on the previous MoE layer's gate input. The first is as late as a read can start and still
overlap anything: that one attention.

``--cross-token`` asks the same of the next token's first MoE layer, the read the oracle bound makes across the
token boundary: how well it can be predicted from the last MoE layer's gate input, before the lm_head and the
sampler have run (a read started there would overlap them), against the layer's expert popularity (what a cache
already holds) and against the token table applied to the sampled token (a read started only after sampling).

The pre-attention inputs come from transformers' ``output_hidden_states`` (a test and training dependency); the
routing from fate-edge's forward.

    python research/predictor_ceiling.py --tokens 131072 --json bench-out/predictor_ceiling.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
from fate_edge.predictors import CrossLayerGate
from fate_edge.predictors.base import next_moe_layers
from fate_edge.predictors.early_attention import early_gate_inputs
from fate_edge.predictors.evaluate import Trace, collect_traces, evaluate_predictor, exact_match, recall_at
from fate_edge.predictors.learned import TrainConfig, train_learned
from fate_edge.predictors.previous_input import widen_trace

from fate_edge.bundled import bundled_model_dir
from fate_edge.model.layer import rms_norm
from fate_edge.planning.calibrate import CalibrateOptions, corpus_windows, separator_id
from fate_edge.runtime.loader import load_model
from fate_edge.tokenizer import Tokenizer


@torch.no_grad()
def pre_attention_inputs(
    hf: torch.nn.Module, windows: torch.Tensor, layers: list[int], batch: int
) -> dict[int, torch.Tensor]:
    """Layer j's input (the residual stream before its attention) for every token of ``windows``, from the
    transformers model ``hf``, rows in collect_traces' order (batch-major, then position)."""
    out: dict[int, list[torch.Tensor]] = {j: [] for j in layers}
    for s in range(0, len(windows), batch):
        states = hf(input_ids=windows[s : s + batch], output_hidden_states=True).hidden_states
        for j in layers:  # hidden_states[j] is layer j-1's output, i.e. layer j's input
            out[j].append(states[j].reshape(-1, states[j].shape[-1]).float())
    return {j: torch.cat(v) for j, v in out.items()}


@torch.no_grad()
def own_router_rows(model, held: Trace, x_held: dict[int, torch.Tensor]) -> dict[str, dict[int, dict[str, float]]]:
    """Per MoE layer j: exact / recall@k of j's own router on j's pre-attention input, and of the norm-aware
    cross-layer gate on the previous MoE layer's gate input (None for the first)."""
    cfg, plan = model.config, model.plan()
    own, cross = {}, {}
    for j in cfg.moe_layers:
        h = rms_norm(x_held[j].to(model.dtype), plan[j].post_norm, cfg.rms_norm_eps)
        own[j] = scores(model.route(j, h)[1], held.expert_ids[j])
    gate = CrossLayerGate.from_model(model, 1, norm_variant=True)
    for a in evaluate_predictor(gate, held, [held.top_k]):
        if a.distance == 1:
            cross[a.target] = {"exact": a.exact, "recall": a.recall[min(a.recall)]}
    return {
        "layer j's router on its input before its attention": own,
        "cross-layer gate (norm-aware) on the previous MoE layer's gate input": cross,
    }


def beside(trace: Trace, extra: dict[int, torch.Tensor]) -> Trace:
    """``trace`` whose sources in ``extra`` read [h_i, extra_i] (the others are left out)."""
    return Trace(
        {i: torch.cat([trace.gate_inputs[i].float(), e], 1) for i, e in extra.items()},
        trace.expert_ids,
        trace.num_experts,
    )


def scores(pred: torch.Tensor, true: torch.Tensor) -> dict[str, float]:
    return {"exact": exact_match(pred, true), "recall": recall_at(pred, true)}


def print_by_target(rows: dict[str, dict[int, dict[str, float]]], layers: list[int]) -> None:
    print("| source | " + " | ".join(f"layer {j}" for j in layers) + " | mean |")
    print("|---|" + "---:|" * (len(layers) + 1))
    for name, got in rows.items():
        cells = [f"{100 * got[j]['exact']:.1f} / {100 * got[j]['recall']:.1f}" if j in got else "—" for j in layers]
        mean = [sum(got[j][m] for j in got) / max(1, len(got)) for m in ("exact", "recall")]
        print(f"| {name} | " + " | ".join(cells) + f" | {100 * mean[0]:.1f} / {100 * mean[1]:.1f} |")


def write_json(path: Path | None, report: dict, t0: float) -> None:
    """``report`` and the seconds since ``t0`` to ``path`` (``--json``), if one was given."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**report, "seconds": round(time.time() - t0, 1)}, indent=1))


def per_layer(results) -> dict[int, dict[str, float]]:
    return {
        a.source: {"target": a.target, "exact": a.exact, "recall": a.recall[min(a.recall)]}
        for a in results
        if a.distance == 1
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", type=Path, default=None, help="model directory (default: the bundled model)")
    ap.add_argument("--corpus", type=Path, default=None, help="text (required unless the model is the bundled one)")
    ap.add_argument("--tokens", type=int, default=131072, help="tokens traced, training + held-out")
    ap.add_argument("--heldout-fraction", type=float, default=0.1)
    ap.add_argument("--rank", type=int, default=TrainConfig.rank)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="both models' weights (bfloat16 halves the memory of a real-shape checkpoint)",
    )
    ap.add_argument(
        "--routers-only",
        action="store_true",
        help="train nothing: score each layer's own router on its pre-attention input (see above)",
    )
    ap.add_argument(
        "--cross-token",
        action="store_true",
        help="predict the next token's first MoE layer from the last one's gate input (see above)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = args.model or bundled_model_dir()
    t0 = time.time()
    dtype = getattr(torch, args.dtype)
    model, tokenizer = load_model(model_dir, dtype), Tokenizer(model_dir)
    opts = CalibrateOptions(corpus=args.corpus, tokens=args.tokens, heldout_fraction=args.heldout_fraction)
    train_ids, held_ids, corpus = corpus_windows(model_dir, tokenizer, separator_id(tokenizer, model.config), opts)
    moe = model.config.moe_layers
    if args.routers_only:
        routers_only(args, model, model_dir, held_ids, corpus, dtype, t0)
        return
    if args.cross_token:
        cross_token(args, model, model_dir, train_ids, held_ids, corpus, t0)
        return
    train, held = collect_traces(model, train_ids.split(4)), collect_traces(model, held_ids.split(4))
    pairs = {i: next_moe_layers(moe, i, 1)[0] for i in moe if next_moe_layers(moe, i, 1)}
    targets = sorted(set(pairs.values()))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    inputs = sorted(set(targets) | set(pairs))  # sources too: early attention needs their residuals
    x_train, x_held = (pre_attention_inputs(hf, ids, inputs, 4) for ids in (train_ids, held_ids))
    del hf

    def later(trace: Trace, x: dict[int, torch.Tensor]) -> Trace:  # source i reads layer i+1's pre-attention input
        return Trace({i: x[j] for i, j in pairs.items()}, trace.expert_ids, trace.num_experts)

    gate = CrossLayerGate.from_model(model, 1, norm_variant=True)
    cfg = TrainConfig(kind="lowrank", rank=args.rank)
    rows = {"cross-layer gate on layer i's gate input": per_layer(evaluate_predictor(gate, held, [train.top_k]))}
    learned = train_learned(gate, train, config=cfg, progress=False)
    rows["learned on layer i's gate input"] = per_layer(evaluate_predictor(learned, held, [train.top_k]))
    pre = train_learned(gate, later(train, x_train), config=cfg, progress=False)
    rows["learned on layer i+1's input before its attention"] = per_layer(
        evaluate_predictor(pre, later(held, x_held), [train.top_k])
    )

    # Source i reads [h_i(t), h_{i+1}(t-1)], as `fate-edge calibrate --previous-input` trains it.
    prev = train_learned(
        gate,
        widen_trace(train, moe, opts.seq_len),
        config=dataclasses.replace(cfg, previous_input=True),
        progress=False,
    )
    rows["learned on layer i's gate input + the previous token's layer i+1 gate input"] = per_layer(
        evaluate_predictor(prev, widen_trace(held, moe, opts.seq_len), [train.top_k])
    )

    # Source i reads [h_i(t), s_{i+1}(t)]: layer i+1's attention run early on layer i's residual
    # (early_attention.py). train_learned takes any doubled input as it takes the previous one; nothing is dropped.
    early_cfg = dataclasses.replace(cfg, previous_input=True, previous_dropout=0.0)
    early = train_learned(
        gate, beside(train, early_gate_inputs(model, x_train, opts.seq_len)), config=early_cfg, progress=False
    )
    rows["learned on layer i's gate input + layer i+1's attention run early on layer i's residual"] = per_layer(
        evaluate_predictor(early, beside(held, early_gate_inputs(model, x_held, opts.seq_len)), [train.top_k])
    )

    k = train.top_k
    print(
        f"Model {model_dir.name}: {train.tokens:,} training and {held.tokens:,} held-out tokens "
        f"({corpus['source']}); exact top-{k} / recall@{k} one MoE layer ahead, rank {args.rank}.\n"
    )
    print("| predictor | " + " | ".join(f"{i} → {j}" for i, j in pairs.items()) + " | mean |")
    print("|---|" + "---:|" * (len(pairs) + 1))
    for name, got in rows.items():
        cells = [f"{100 * got[i]['exact']:.1f} / {100 * got[i]['recall']:.1f}" for i in pairs]
        mean_exact = sum(got[i]["exact"] for i in pairs) / len(pairs)
        mean_recall = sum(got[i]["recall"] for i in pairs) / len(pairs)
        print(f"| {name} | " + " | ".join(cells) + f" | {100 * mean_exact:.1f} / {100 * mean_recall:.1f} |")
    print(f"\n({time.time() - t0:.0f} s, torch {torch.__version__}, {args.threads} threads)")
    write_json(args.json, {"model": str(model_dir), "corpus": corpus, "rank": args.rank, "k": k, "rows": rows}, t0)


def routers_only(
    args, model, model_dir: Path, held_ids: torch.Tensor, corpus: dict, dtype: torch.dtype, t0: float
) -> None:
    """``--routers-only``: the held-out text only, nothing trained (:func:`own_router_rows`)."""
    from transformers import AutoModelForCausalLM

    held = collect_traces(model, held_ids.split(4))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    x_held = pre_attention_inputs(hf, held_ids, model.config.moe_layers, 4)
    del hf
    rows = own_router_rows(model, held, x_held)
    k = held.top_k
    print(
        f"Model {model_dir.name}: {held.tokens:,} held-out tokens ({corpus['source']}); exact top-{k} / recall@{k} "
        f"of each MoE layer's experts, no training, {args.dtype}.\n"
    )
    print_by_target(rows, model.config.moe_layers)
    print(f"\n({time.time() - t0:.0f} s, torch {torch.__version__}, {args.threads} threads)")
    write_json(args.json, {"model": str(model_dir), "corpus": corpus, "k": k, "dtype": args.dtype, "rows": rows}, t0)


def next_token_pairs(trace: Trace, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (t, t + 1) of the same window: each token's row and its successor's (rows are window-major)."""
    rows = torch.arange(trace.tokens)
    src = rows[rows % seq_len < seq_len - 1]
    return src, src + 1


def cross_token_trace(trace: Trace, seq_len: int, first: int, last: int) -> Trace:
    """A two-layer trace for train_learned: pseudo-layer 0 reads the last MoE layer's gate input at token t,
    pseudo-layer 1 holds the first MoE layer's experts at token t + 1."""
    src, dst = next_token_pairs(trace, seq_len)
    return Trace(
        {0: trace.gate_inputs[last][src]},
        {0: trace.expert_ids[last][src], 1: trace.expert_ids[first][dst]},
        trace.num_experts,
    )


def cross_token_gate(model) -> CrossLayerGate:
    """The first MoE layer's router on the last one's gate input (norm-aware: rescaled by the ratio of their
    post-attention norms), as a gate over pseudo-layers 0 → 1 (:func:`cross_token_trace`)."""
    cfg, names = model.config, model.names
    first, last = cfg.moe_layers[0], cfg.moe_layers[-1]
    router = model.w[f"{names[first].mlp}.gate.weight"]
    norms = {0: model.w[f"{names[last].post_attn_norm}.weight"], 1: model.w[f"{names[first].post_attn_norm}.weight"]}
    return CrossLayerGate({0: router, 1: router}, 1, norms)


def cross_token(
    args, model, model_dir: Path, train_ids: torch.Tensor, held_ids: torch.Tensor, corpus: dict, t0: float
) -> None:
    """``--cross-token``: the next token's first MoE layer, predicted before it is sampled and after."""
    from fate_edge.predictors.token_popularity import TokenPopularity

    seq_len = train_ids.shape[1]
    train, held = collect_traces(model, train_ids.split(4)), collect_traces(model, held_ids.split(4))
    first, last, k = model.config.moe_layers[0], model.config.moe_layers[-1], train.top_k
    _, dst = next_token_pairs(held, seq_len)
    true = held.expert_ids[first][dst]
    popular = torch.bincount(train.expert_ids[first].flatten(), minlength=train.num_experts).float()
    gate = cross_token_gate(model)
    held_pair = cross_token_trace(held, seq_len, first, last)
    learned = train_learned(
        gate,
        cross_token_trace(train, seq_len, first, last),
        config=TrainConfig(kind="lowrank", rank=args.rank),
        progress=False,
    )
    table = TokenPopularity.from_trace(train, model.config.vocab_size, 1)
    rows = {
        "expert popularity (no input)": popular.expand(len(dst), -1),
        "first layer's router on the last layer's gate input (norm-aware, untrained)": gate.predict(
            0, held_pair.gate_inputs[0]
        ).scores[0],
        "learned on the last layer's gate input (before the lm_head)": learned.predict(
            0, held_pair.gate_inputs[0]
        ).scores[0],
        "token table on the sampled token (after the lm_head and sampler)": table.predict_from_tokens(
            held.token_ids[dst]
        ).scores[0],
    }
    widths = (k, k + 2)
    print(
        f"Model {model_dir.name}: {train.tokens:,} training and {held.tokens:,} held-out tokens "
        f"({corpus['source']}); the next token's MoE layer {first} from token t, "
        f"exact top-{k} / recall@{widths[0]} / recall@{widths[1]}, "
        f"rank {args.rank}.\n"
    )
    print(f"| predictor of token t+1's layer-{first} experts | exact | recall@{widths[0]} | recall@{widths[1]} |")
    print("|---|---:|---:|---:|")
    report = {}
    for name, got in rows.items():
        top = got.topk(widths[1]).indices
        report[name] = {
            "exact": exact_match(top[:, :k], true),
            **{f"recall@{w}": recall_at(top[:, :w], true) for w in widths},
        }
        print(f"| {name} | " + " | ".join(f"{100 * v:.1f}" for v in report[name].values()) + " |")
    print(f"\n({time.time() - t0:.0f} s, torch {torch.__version__}, {args.threads} threads)")
    write_json(args.json, {"model": str(model_dir), "corpus": corpus, "rank": args.rank, "k": k, "rows": report}, t0)


if __name__ == "__main__":
    main()
