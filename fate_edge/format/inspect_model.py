"""``fate-edge inspect``: what a model directory holds, and where its bytes are."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from fate_edge.format.checkpoint import CheckpointReader
from fate_edge.format.checkpoint_layout import is_routed_expert_tensor
from fate_edge.format.prequantized import stored_params
from fate_edge.model.arch import ModelConfig, load_config
from fate_edge.sizes import format_bytes


@dataclass
class LayerSummary:
    layer: int
    kind: str  # "moe" or "dense"
    experts: int
    expert_shapes: list[list[int]]  # gate, up, down of one expert
    expert_bytes: int  # one expert, as stored


@dataclass
class ModelSummary:
    path: str
    config: ModelConfig
    total_params: int
    expert_params: int
    resident_params: int
    expert_bytes: int
    resident_bytes: int
    layers: list[LayerSummary] = field(default_factory=list)
    expert_precision: str = "as stored"  # stores: the precision expert_bytes counts

    @property
    def active_params_per_token(self) -> int:
        per_expert = self.expert_params // max(1, self.config.num_experts * len(self.config.moe_layers))
        return self.resident_params + per_expert * self.config.num_experts_per_tok * len(self.config.moe_layers)


def summarize(model_dir: str | Path) -> ModelSummary:
    """Parameter and byte counts of a model directory, or of an expert store (its experts counted from
    store.json at the precision the engine streams by default, not as absent from resident.safetensors)."""
    from fate_edge.format.store import ExpertStore, is_store

    config = load_config(model_dir)
    reader = CheckpointReader(model_dir)
    exp_p = exp_b = res_p = res_b = 0
    for name in reader.keys():
        n = stored_params(name, math.prod(reader.shape(name)))  # convert --resident-bits: the weights codes stand for
        if is_routed_expert_tensor(name):
            exp_p, exp_b = exp_p + n, exp_b + reader.nbytes(name)
        else:
            res_p, res_b = res_p + n, res_b + reader.nbytes(name)
    n_moe = max(1, len(config.moe_layers))
    precision = "as stored"
    if is_store(model_dir):
        store = ExpertStore(model_dir)
        bits = max((b for b in store.bits_available if b < 16), default=16)
        n_experts = len(config.moe_layers) * config.num_experts
        exp_p = n_experts * config.expert_params
        exp_b = n_experts * store.expert_bytes(bits)
        precision = "at " + ("bf16" if bits == 16 else f"int{bits}") + ", the copy the engine streams,"
    layers = []
    for i in range(config.num_hidden_layers):
        if config.is_moe_layer(i):
            h, inter = config.hidden_size, config.moe_intermediate_size
            layers.append(
                LayerSummary(
                    i,
                    "moe",
                    config.num_experts,
                    [[inter, h], [inter, h], [h, inter]],
                    exp_b // (n_moe * config.num_experts),
                )
            )
        else:
            layers.append(LayerSummary(i, "dense", 0, [], 0))
    return ModelSummary(str(model_dir), config, exp_p + res_p, exp_p, res_p, exp_b, res_b, layers, precision)


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    """Columns as wide as their widest cell; the ``right`` columns right-aligned (numbers)."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        for r in [header, *rows]
    ]


def format_summary(s: ModelSummary) -> str:
    c = s.config
    lines = [
        f"model          {s.path}",
        f"architecture   {c.model_type}  ({c.num_hidden_layers} layers, hidden {c.hidden_size}, "
        f"{c.num_attention_heads} heads / {c.num_key_value_heads} kv heads, vocab {c.vocab_size})",
        f"experts        {c.num_experts} per MoE layer, top-{c.num_experts_per_tok}, width {c.moe_intermediate_size}"
        + (f", shared expert width {c.shared_expert_intermediate_size}" if c.shared_expert_intermediate_size else ""),
        f"parameters     {s.total_params / 1e6:.2f} M total, {s.active_params_per_token / 1e6:.2f} M active per token",
        f"expert bytes   {format_bytes(s.expert_bytes)} {s.expert_precision} ({s.expert_params / 1e6:.2f} M params, "
        f"{100 * s.expert_bytes / max(1, s.expert_bytes + s.resident_bytes):.0f}% of the model)",
        f"resident bytes {format_bytes(s.resident_bytes)} ({s.resident_params / 1e6:.2f} M params)",
        "",
    ]
    rows = [
        [
            str(lay.layer),
            lay.kind,
            str(lay.experts),
            " ".join("x".join(map(str, sh)) for sh in lay.expert_shapes) or "-",
            format_bytes(lay.expert_bytes) if lay.expert_bytes else "-",
        ]
        for lay in s.layers
    ]
    lines += _table(["layer", "kind", "experts", "expert shapes (gate, up, down)", "bytes/expert"], rows, {0, 2, 4})
    return "\n".join(lines)


def format_store(path: str | Path) -> str:
    """Precisions, files and blob sizes of an expert store."""
    from fate_edge.format.store import ExpertStore

    store = ExpertStore(path)
    rows = []
    for bits, p in sorted(store.precisions.items()):
        n = sum(1 for k in store.refs if k[2] == bits)
        size = (Path(path) / p.file).stat().st_size
        name = "bf16" if p.spec is None else str(p.spec)
        rows.append([name, p.file, format_bytes(p.blob_bytes), format_bytes(p.slot_bytes), str(n), format_bytes(size)])
    return "\n".join(_table(["precision", "file", "blob", "slot", "experts", "file size"], rows, {2, 3, 4, 5}))
