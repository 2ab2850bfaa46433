"""``fate-edge inspect``: what a model directory holds, and where its bytes are."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .arch import ModelConfig, load_config
from .checkpoint import CheckpointReader
from .loader import is_routed_expert_tensor


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

    @property
    def active_params_per_token(self) -> int:
        per_expert = self.expert_params // max(1, self.config.num_experts * len(self.config.moe_layers))
        return self.resident_params + per_expert * self.config.num_experts_per_tok * len(self.config.moe_layers)


def summarize(model_dir: str | Path) -> ModelSummary:
    config = load_config(model_dir)
    reader = CheckpointReader(model_dir)
    exp_p = exp_b = res_p = res_b = 0
    for name in reader.keys():
        shape = reader.shape(name)
        n = 1
        for d in shape:
            n *= d
        if is_routed_expert_tensor(name):
            exp_p, exp_b = exp_p + n, exp_b + reader.nbytes(name)
        else:
            res_p, res_b = res_p + n, res_b + reader.nbytes(name)
    layers = []
    n_moe = max(1, len(config.moe_layers))
    for i in range(config.num_hidden_layers):
        if config.is_moe_layer(i):
            h, inter = config.hidden_size, config.moe_intermediate_size
            layers.append(LayerSummary(i, "moe", config.num_experts, [[inter, h], [inter, h], [h, inter]],
                                       exp_b // (n_moe * config.num_experts)))
        else:
            layers.append(LayerSummary(i, "dense", 0, [], 0))
    return ModelSummary(str(model_dir), config, exp_p + res_p, exp_p, res_p, exp_b, res_b, layers)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GB"


def format_summary(s: ModelSummary) -> str:
    c = s.config
    lines = [
        f"model          {s.path}",
        f"architecture   {c.model_type}  ({c.num_hidden_layers} layers, hidden {c.hidden_size}, "
        f"{c.num_attention_heads} heads / {c.num_key_value_heads} kv heads, vocab {c.vocab_size})",
        f"experts        {c.num_experts} per MoE layer, top-{c.num_experts_per_tok}, width {c.moe_intermediate_size}"
        + (f", shared expert width {c.shared_expert_intermediate_size}" if c.shared_expert_intermediate_size else ""),
        f"parameters     {s.total_params / 1e6:.2f} M total, {s.active_params_per_token / 1e6:.2f} M active per token",
        f"expert bytes   {_fmt_bytes(s.expert_bytes)} ({s.expert_params / 1e6:.2f} M params, "
        f"{100 * s.expert_bytes / max(1, s.expert_bytes + s.resident_bytes):.0f}% of the model)",
        f"resident bytes {_fmt_bytes(s.resident_bytes)} ({s.resident_params / 1e6:.2f} M params)",
        "",
        "layer  kind   experts  expert shapes (gate, up, down)        bytes/expert",
    ]
    for lay in s.layers:
        shapes = " ".join("x".join(map(str, sh)) for sh in lay.expert_shapes) or "-"
        lines.append(f"{lay.layer:>5}  {lay.kind:<5}  {lay.experts:>7}  {shapes:<36}  "
                     f"{_fmt_bytes(lay.expert_bytes) if lay.expert_bytes else '-'}")
    return "\n".join(lines)


def format_store(path: str | Path) -> str:
    """Precisions, files and blob sizes of an expert store."""
    from .store import ExpertStore

    store = ExpertStore(path)
    lines = ["precision  file               blob bytes  slot bytes  experts  file size"]
    for bits, p in sorted(store.precisions.items()):
        n = sum(1 for k in store.refs if k[2] == bits)
        size = (Path(path) / p.file).stat().st_size
        name = "bf16" if p.spec is None else str(p.spec)
        lines.append(f"{name:<10} {p.file:<18} {p.blob_bytes:>10}  {p.slot_bytes:>10}  {n:>7}  {_fmt_bytes(size)}")
    return "\n".join(lines)
