"""What running a store needs in memory: resident weights + the expert budget + the runtime's own baseline.

The budget bounds everything expert-related (cache, read buffers, the expert being computed, see
``engine.plan_budget``); the rest is the weights that never stream and the process itself. A memory cap
(cgroup, container limit) set to ``MemoryNeed.total`` is what a deployment should reserve.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from fate_edge.format.checkpoint import CheckpointReader
from fate_edge.format.checkpoint_layout import DTYPES, FP32_SUFFIXES, layer_names, resident_weight_names
from fate_edge.format.prequantized import is_float_weight
from fate_edge.model.arch import load_config
from fate_edge.model.layer import quantized_group_bytes, resident_groups

# Interpreter + torch + tokenizers + onnxruntime + fate_edge imported, plus torch's allocator arenas and
# the activations of a prefill chunk (measured on this host: ~330 MB after imports, see `fate-edge bench-scale`).
RUNTIME_BASELINE_BYTES = 600_000_000
_KV_DTYPE_BYTES = 4  # the KV cache is kept in the compute dtype; fp32 is the widest


@dataclass(frozen=True)
class MemoryNeed:
    resident_bytes: int  # weights that never stream (embeddings, attention, norms, routers, shared experts)
    budget_bytes: int  # the expert budget (cache + read buffers + expert being computed)
    baseline_bytes: int  # the runtime itself and a KV cache of ``context_tokens``

    @property
    def total(self) -> int:
        return self.resident_bytes + self.budget_bytes + self.baseline_bytes


def resident_bytes(
    store_dir: str | Path, dtype: str | torch.dtype = "bfloat16", resident_bits: int | None = None
) -> int:
    """Bytes the resident weights take once loaded at ``dtype`` (routers stay fp32, as the loader keeps them),
    with ``resident_bits`` (8 or 4) the fused linears quantized as the loader does (``fused.quantize_group``)."""
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    cfg = load_config(store_dir)
    reader = CheckpointReader(store_dir)
    names = resident_weight_names(cfg, reader)
    if not all(is_float_weight(n) for n in names):  # quantized at convert: the account reads what the store holds
        from fate_edge.runtime.memory_account import _weights

        embed, other, _, _ = _weights(Path(store_dir), dtype, resident_bits, None)
        return embed + other
    width = torch.empty(0, dtype=dtype).element_size()
    size = {name: 4 if name.endswith(FP32_SUFFIXES) else width for name in names}
    total = sum(_numel(reader.shape(name)) * size[name] for name in names)
    if resident_bits is None:
        return total
    for group in resident_groups(cfg, layer_names(cfg, reader), set(names)):
        shapes = [reader.shape(f"{n}.weight") for n in group]
        total -= sum(_numel(s) * size[f"{n}.weight"] for n, s in zip(group, shapes))
        total += quantized_group_bytes((sum(s[0] for s in shapes), shapes[0][1]), len(group), resident_bits)
    return total


def _numel(shape) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel


def kv_cache_bytes(store_dir: str | Path, context_tokens: int) -> int:
    """Upper bound of the KV cache for ``context_tokens`` (it grows by doubling, so up to twice the tokens)."""
    cfg = load_config(store_dir)
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * heads * head_dim * 2 * max(64, context_tokens) * _KV_DTYPE_BYTES


def memory_need(
    store_dir: str | Path,
    budget: int,
    dtype: str | torch.dtype = "bfloat16",
    context_tokens: int = 2048,
    resident_bits: int | None = None,
) -> MemoryNeed:
    """What an Engine on ``store_dir`` with expert budget ``budget`` (and ``resident_bits``) needs in memory
    (see module doc)."""
    return MemoryNeed(
        resident_bytes(store_dir, dtype, resident_bits),
        int(budget),
        RUNTIME_BASELINE_BYTES + kv_cache_bytes(store_dir, context_tokens),
    )
