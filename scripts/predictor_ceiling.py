"""How much of the learned predictor's miss is information that does not exist yet one layer ahead.

On a model's own text (the bundled model and its stdlib split by default), this trains the low-rank predictor
with `fate-edge calibrate`'s recipe one MoE layer ahead on two inputs and scores both on held-out text:

1. layer i's gate input: what fate-edge's predictor reads (Fate's source), early enough to read ahead;
2. layer i+1's input before its attention: everything but that attention (a later, "pre-attention" source,
   arXiv 2511.10676): an estimate of what any predictor that runs before layer i+1's attention could know.

3. layer i's gate input beside the previous token's layer i+1 gate input: in decode that token's forward is
   finished, so this is causal; it carries what layer i+1's attention saw one position earlier.

Layer i+1's own router on its gate input is exact by definition, so the gap between 2. and 100% is what layer
i+1's attention (the context of the other tokens) decides; 3. measures how much of that the previous position
already holds. The pre-attention inputs come from transformers' ``output_hidden_states`` (a test and training
dependency); the routing from fate-edge's forward.

    python scripts/predictor_ceiling.py --tokens 131072 --json bench-out/predictor_ceiling.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from fate_edge.predictors import CrossLayerGate
from fate_edge.predictors.base import next_moe_layers
from fate_edge.predictors.evaluate import Trace, collect_traces, evaluate_predictor
from fate_edge.predictors.learned import TrainConfig, train_learned

from fate_edge.bundled import bundled_model_dir
from fate_edge.calibrate import CalibrateOptions, corpus_windows, separator_id
from fate_edge.loader import load_model
from fate_edge.tokenizer import Tokenizer


@torch.no_grad()
def pre_attention_inputs(hf: torch.nn.Module, windows: torch.Tensor, layers: list[int],
                         batch: int) -> dict[int, torch.Tensor]:
    """Layer j's input (the residual stream before its attention) for every token of ``windows``, from the
    transformers model ``hf``, rows in collect_traces' order (batch-major, then position)."""
    out: dict[int, list[torch.Tensor]] = {j: [] for j in layers}
    for s in range(0, len(windows), batch):
        states = hf(input_ids=windows[s : s + batch], output_hidden_states=True).hidden_states
        for j in layers:  # hidden_states[j] is layer j-1's output, i.e. layer j's input
            out[j].append(states[j].reshape(-1, states[j].shape[-1]).float())
    return {j: torch.cat(v) for j, v in out.items()}


def previous_position(x: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Row t holds row t-1 of the same window (zeros at a window's first position): rows are window-major."""
    w = x.view(-1, seq_len, x.shape[-1])
    out = torch.zeros_like(w)
    out[:, 1:] = w[:, :-1]
    return out.reshape(x.shape)


class WidenedGate:
    """``gate`` reading [h_i, extra] rows: its stacked routers padded with zero columns, so the learned predictor
    starts as the gate and training decides what the extra columns are worth."""

    def __init__(self, gate: CrossLayerGate, extra: int):
        self.gate, self.extra = gate, extra
        self.moe_layers, self.num_experts, self.lookahead, self.norms = (
            gate.moe_layers, gate.num_experts, gate.lookahead, gate.norms)

    def targets(self, layer: int) -> list[int]:
        return self.gate.targets(layer)

    def stacked(self, layer: int) -> torch.Tensor:
        w = self.gate.stacked(layer)
        return torch.cat([w, w.new_zeros(w.shape[0], self.extra)], dim=1)


def per_layer(results) -> dict[int, dict[str, float]]:
    return {a.source: {"target": a.target, "exact": a.exact, "recall": a.recall[min(a.recall)]}
            for a in results if a.distance == 1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", type=Path, default=None, help="model directory (default: the bundled model)")
    ap.add_argument("--corpus", type=Path, default=None, help="text (required unless the model is the bundled one)")
    ap.add_argument("--tokens", type=int, default=131072, help="tokens traced, training + held-out")
    ap.add_argument("--heldout-fraction", type=float, default=0.1)
    ap.add_argument("--rank", type=int, default=TrainConfig.rank)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = args.model or bundled_model_dir()
    t0 = time.time()
    model, tokenizer = load_model(model_dir, torch.float32), Tokenizer(model_dir)
    opts = CalibrateOptions(corpus=args.corpus, tokens=args.tokens, heldout_fraction=args.heldout_fraction)
    train_ids, held_ids, corpus = corpus_windows(model_dir, tokenizer, separator_id(tokenizer, model.config), opts)
    train, held = collect_traces(model, train_ids.split(4)), collect_traces(model, held_ids.split(4))
    moe = model.config.moe_layers
    pairs = {i: next_moe_layers(moe, i, 1)[0] for i in moe if next_moe_layers(moe, i, 1)}
    targets = sorted(set(pairs.values()))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    x_train, x_held = (pre_attention_inputs(hf, ids, targets, 4) for ids in (train_ids, held_ids))
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
        evaluate_predictor(pre, later(held, x_held), [train.top_k]))

    def with_previous(trace: Trace) -> Trace:  # source i reads [h_i(t), h_{i+1}(t-1)]
        return Trace({i: torch.cat([trace.gate_inputs[i], previous_position(trace.gate_inputs[j], opts.seq_len)], 1)
                      for i, j in pairs.items()}, trace.expert_ids, trace.num_experts)

    hidden = model.config.hidden_size
    prev = train_learned(WidenedGate(gate, hidden), with_previous(train), config=cfg, progress=False)
    rows["learned on layer i's gate input + the previous token's layer i+1 gate input"] = per_layer(
        evaluate_predictor(prev, with_previous(held), [train.top_k]))

    k = train.top_k
    print(f"Model {model_dir.name}: {train.tokens:,} training and {held.tokens:,} held-out tokens "
          f"({corpus['source']}); exact top-{k} / recall@{k} one MoE layer ahead, rank {args.rank}.\n")
    print("| predictor | " + " | ".join(f"{i} → {j}" for i, j in pairs.items()) + " | mean |")
    print("|---|" + "---:|" * (len(pairs) + 1))
    for name, got in rows.items():
        cells = [f"{100 * got[i]['exact']:.1f} / {100 * got[i]['recall']:.1f}" for i in pairs]
        mean_exact = sum(got[i]["exact"] for i in pairs) / len(pairs)
        mean_recall = sum(got[i]["recall"] for i in pairs) / len(pairs)
        print(f"| {name} | " + " | ".join(cells) + f" | {100 * mean_exact:.1f} / {100 * mean_recall:.1f} |")
    print(f"\n({time.time() - t0:.0f} s, torch {torch.__version__}, {args.threads} threads)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": str(model_dir), "corpus": corpus, "rank": args.rank, "k": k,
                                         "rows": rows, "seconds": round(time.time() - t0, 1)}, indent=1))


if __name__ == "__main__":
    main()
