"""Router structure of a model, as fate-edge's own evaluation code measures it on held-out Python source."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from fate_edge.predictors.cross_layer_gate import CrossLayerGate
from fate_edge.predictors.evaluate import collect_traces, evaluate_predictor, usage_stats

from fate_edge.corpus import heldout_source
from fate_edge.runtime.loader import load_model
from fate_edge.tokenizer import Tokenizer


@dataclass
class RouterStructureReport:
    tokens: int
    entropy: dict[int, float]  # MoE layer → usage entropy / log E
    recall: dict[int, float]  # target MoE layer → cross-layer gate recall@k from the previous MoE layer

    def summary(self) -> str:
        e, r = list(self.entropy.values()), list(self.recall.values())
        return (
            f"{self.tokens} tokens: usage entropy / log E {min(e):.3f}..{max(e):.3f} (mean {sum(e) / len(e):.3f}); "
            + (
                f"cross-layer gate recall@k {min(r):.3f}..{max(r):.3f} (mean {sum(r) / len(r):.3f})"
                if r
                else "one MoE layer: no cross-layer recall"
            )
        )


@torch.no_grad()
def measure_router_structure(model_dir: str | Path, tokens: int = 512, seq_len: int = 128) -> RouterStructureReport:
    """Run the model (fp32, experts resident) on ``tokens`` held-out stdlib tokens in windows of ``seq_len``."""
    model = load_model(model_dir)
    ids = Tokenizer(model_dir).encode(heldout_source(tokens * 16)[0], add_special_tokens=False)
    n = min(len(ids), tokens) // seq_len * seq_len
    trace = collect_traces(model, [torch.tensor(ids[:n]).view(-1, seq_len)])
    k = trace.top_k
    acc = evaluate_predictor(CrossLayerGate.from_model(model), trace, widths=[k])
    return RouterStructureReport(
        n, {u.layer: u.entropy for u in usage_stats(trace)}, {a.target: a.recall[k] for a in acc if a.distance == 1}
    )
