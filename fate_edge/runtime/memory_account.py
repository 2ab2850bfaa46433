"""The memory account: a run's peak RSS by part, predicted before anything loads (docs/memory.md).

    peak = runtime + max(loading, embeddings + other resident + expert budget + KV cache + buffers)

``loading`` is the most the loader holds at once on its way to the resident part: the weights read so far plus
the one being read and, where the resident linears are quantized at load (``resident_bits`` on a store written
without ``convert --resident-bits``), that group in full precision with its codes. Everything is in bytes on the
host (CPU); a discrete GPU's cache lives in GPU memory instead: once planned, ``tiers`` splits the expert budget
into the device's and the host's (runtime.memory_tiers), and only the host's counts here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from fate_edge import defaults
from fate_edge.format.checkpoint import CheckpointReader
from fate_edge.format.checkpoint_layout import DTYPES, FP32_SUFFIXES, layer_names, resident_weight_names
from fate_edge.format.prequantized import in_store, is_float_weight
from fate_edge.format.store import ExpertStore, is_store
from fate_edge.model import recurrent
from fate_edge.model.arch import ModelConfig, load_config
from fate_edge.model.kv_cache import window_layers, window_positions
from fate_edge.model.layer import quantized_group_bytes, resident_groups
from fate_edge.runtime.generate import PREFILL_CHUNK
from fate_edge.runtime.memory_tiers import MemoryTiers
from fate_edge.runtime.prompt_heap import views_only
from fate_edge.sizes import format_bytes

EMBEDDING = "model.embed_tokens.weight"
EMBEDDING_PREFIX = "model.embed_tokens."  # the float table, or a quantized one's codes and scales
# Interpreter + torch + fate_edge imported, when this process's own RSS cannot be read (measured with torch
# 2.13 CPU on x86-64: python 11 MB, + torch 284 MB, + fate_edge 298 MB).
RUNTIME_FALLBACK_BYTES = 300_000_000
# Buffers: torch's thread pools and allocator arenas once compute starts (+14 MB over the loaded engine at a
# 16-token prompt), then activations per prompt token, fitted on the 2-layer Qwen1.5-MoE slice (H 2048, top-4,
# shared expert 5632): +252 MB at 2048 tokens, 66 MB of it KV cache, so ~90 KB a token = ~22 H values in bf16.
_BUFFER_FIXED_BYTES = 16_000_000
# A prompt's temporaries from the heap (runtime.prompt_heap) peak higher: 8-layer slice, two threads, peak over the
# loaded engine at a 2048-token prompt (four 512-token chunks) 82-90 MB against 61-64 as mappings of their own, up to
# 1.5x the per-token part above; rounded up to 2.
_HEAP_FRAGMENTATION = 2
# Quantizing a group at load holds, per weight: its float copy, the fused copy (several members), the uint8 codes
# and the packed codes with their shifted temporary (measured: lm_head 151936 x 2048 bf16 adds 1.28 GB at load).
_QUANTIZE_BYTES_PER_WEIGHT = 2.0  # codes + packed + temporary, on top of the float bytes


@dataclass(frozen=True)
class MemoryAccount:
    """Predicted peak RSS of one run, by part (bytes)."""

    runtime: int  # interpreter, torch and fate_edge imported
    embeddings: int  # the token embedding table, at the precision held
    other_resident: int  # attention, norms, routers, shared experts, dense MLPs, lm_head
    expert_budget: int  # --memory-budget: cache, read buffers, the expert being computed
    kv_cache: int  # at ``context_tokens`` (generate allocates the request's prompt + answer at once: no doubling)
    buffers: int  # activations of one prefill chunk (at most ``generate.PREFILL_CHUNK`` tokens), thread pools, arenas
    loading: int  # the most the loader holds at once (resident weights so far + the one being read or quantized)
    context_tokens: int
    # The table is quantized at convert: the model reads the rows a pass uses from the store's file
    # (``format.file_rows``) and holds none of it (a gather through its memory map faulted in 121 MB more at a
    # 4000-token prompt of the 2-layer Qwen slice: readahead around every row).
    embeddings_mapped: bool = False
    # finished requests' KV kept for reuse by later prompts (runtime.prompt_cache): never more than this
    prompt_cache: int = 0
    # The experts' two budgets, device and host (runtime.memory_tiers), once the engine has planned them; None: the
    # expert budget is all host memory (a CPU run, and every account before the plan)
    tiers: MemoryTiers | None = None

    @property
    def embeddings_held(self) -> int:
        return 0 if self.embeddings_mapped else self.embeddings

    @property
    def device_budget(self) -> int:
        """Expert bytes in GPU memory (cache slots, the expert computed): 0 with one memory."""
        return self.tiers.in_device_memory if self.tiers is not None else 0

    @property
    def host_budget(self) -> int:
        """Expert bytes in host memory: the whole expert budget with one memory, else pinned staging and host tier."""
        return self.tiers.in_host_memory if self.tiers is not None else self.expert_budget

    @property
    def running(self) -> int:
        return (
            self.embeddings_held
            + self.other_resident
            + self.host_budget
            + self.kv_cache
            + self.prompt_cache
            + self.buffers
        )

    @property
    def peak(self) -> int:
        return self.runtime + max(self.loading, self.running)

    @property
    def to_load(self) -> int:
        """What the run still has to allocate beyond the process as it is now (the runtime)."""
        return self.peak - self.runtime

    def lines(self) -> list[str]:
        """The account in MB, one part a line (what inspect, run and serve print)."""
        mb = lambda n: f"{n / 1e6:8.0f} MB"  # noqa: E731
        rows = [
            ("runtime baseline", self.runtime, "interpreter + torch + fate_edge"),
            (
                "embeddings",
                self.embeddings_held,
                f"read by row from the store ({self.embeddings / 1e6:.0f} MB there)" if self.embeddings_mapped else "",
            ),
            ("other resident weights", self.other_resident, "attention, norms, routers, shared experts, lm_head"),
            ("expert budget", self.host_budget, "cache, read buffers, expert being computed")
            if self.device_budget == 0
            else (
                "host expert budget",
                self.host_budget,
                "pinned read buffers and host tier (the cache is on the GPU)",
            ),
            ("KV cache", self.kv_cache, f"{self.context_tokens} tokens"),
            ("prompt cache", self.prompt_cache, "finished requests' KV, reused by later prompts"),
            (
                "buffers",
                self.buffers,
                f"activations of a {min(self.context_tokens, PREFILL_CHUNK)}-token prefill chunk",
            ),
        ]
        out = [f"  {name:<23}{mb(n)}  {why}".rstrip() for name, n, why in rows]
        if self.loading > self.running:
            out.append(
                f"  {'(loading holds':<23}{mb(self.loading)}  beyond the runtime: quantizing resident "
                "weights at load; convert --resident-bits avoids it)"
            )
        out.append(f"  {'predicted peak RSS':<23}{mb(self.peak)}")
        if self.device_budget:
            out.append(f"  {'GPU expert budget':<23}{mb(self.device_budget)}  cache slots, expert being computed")
        return out

    def summary(self) -> str:
        return (
            f"{format_bytes(self.peak)} (runtime {self.runtime / 1e6:.0f} MB + embeddings "
            f"{self.embeddings_held / 1e6:.0f} + other resident {self.other_resident / 1e6:.0f} + expert budget "
            f"{self.host_budget / 1e6:.0f} + KV cache {self.kv_cache / 1e6:.0f} + prompt cache "
            f"{self.prompt_cache / 1e6:.0f} + buffers "
            f"{self.buffers / 1e6:.0f} MB)"
        )


def current_rss_bytes() -> int:
    """This process's resident set now (VmRSS), or the measured runtime baseline where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            m = re.search(r"VmRSS:\s+(\d+)", f.read())
        return int(m.group(1)) * 1024 if m else RUNTIME_FALLBACK_BYTES
    except OSError:
        return RUNTIME_FALLBACK_BYTES


def window_rings(cfg: ModelConfig, context_tokens: int | None = None) -> dict[int, int]:
    """Sliding-window layers whose cache stops growing short of ``context_tokens`` (None: of any length), by index →
    the positions each holds at most (``kv_cache.window_positions``): a fixed size per sequence, like a recurrent
    state. A window as long as the context costs what a full layer does, counted per token."""
    rings = {i: window_positions(w) for i, w in window_layers(cfg).items()}
    return {i: n for i, n in rings.items() if context_tokens is None or n < context_tokens}


def _position_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """One position of one attention layer: keys and values (MLA: its latent and rope key)."""
    width = torch.empty(0, dtype=dtype).element_size()
    if cfg.mla is not None:
        return (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * width
    return 2 * cfg.num_key_value_heads * cfg.head_dim * width


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, context_tokens: int | None = None) -> int:
    """KV cache bytes one token takes over all attention layers (keys and values; MLA: its latent and rope key)
    serving up to ``context_tokens``; a recurrent layer's state and a sliding-window layer's ring
    (:func:`window_rings`) do not grow with the length (:func:`state_bytes`)."""
    rings = window_rings(cfg, context_tokens)
    attention = sum(1 for i in range(cfg.num_hidden_layers) if cfg.mixer(i) == "attention" and i not in rings)
    return attention * _position_bytes(cfg, dtype)


def state_bytes(cfg: ModelConfig, dtype: torch.dtype, context_tokens: int | None = None) -> int:
    """One sequence's fixed-size state over all layers: recurrent states (convolution windows, DeltaNet matrices)
    and the sliding-window layers' rings that stop short of ``context_tokens``."""
    rings = sum(window_rings(cfg, context_tokens).values())
    return recurrent.state_bytes(cfg, dtype) + rings * _position_bytes(cfg, dtype)


def kv_shape(cfg: ModelConfig, dtype: torch.dtype, context_tokens: int) -> tuple[int, int]:
    """(bytes per token, fixed bytes per sequence) of the KV cache serving up to ``context_tokens`` (64 at least):
    what the account reserves and the batcher's slab is cut from."""
    ctx = max(64, context_tokens)
    return kv_bytes_per_token(cfg, dtype, ctx), state_bytes(cfg, dtype, ctx)


def buffer_bytes(cfg: ModelConfig, dtype: torch.dtype, tokens: int, heap: bool = False) -> int:
    """Activations of a ``tokens`` prefill (see _BUFFER_FIXED_BYTES): ~(10 + 2 top-k) hidden widths a token plus
    two of the widest dense MLP (shared expert or dense layer); ``heap``: served from glibc's heap
    (runtime.prompt_heap), which fragments as chunks come and go (see _HEAP_FRAGMENTATION)."""
    width = torch.empty(0, dtype=dtype).element_size()
    h = cfg.hidden_size
    mlp = max(cfg.shared_expert_intermediate_size, cfg.intermediate_size if cfg.dense_layers else 0)
    per_token = (10 + 2 * cfg.num_experts_per_tok) * h + 2 * mlp
    return _BUFFER_FIXED_BYTES + (_HEAP_FRAGMENTATION if heap else 1) * tokens * per_token * width


def _weights(
    store_dir: Path, dtype: torch.dtype, resident_bits: int | None, embedding_bits: int | None
) -> tuple[int, int, int, bool]:
    """(embedding bytes, other resident bytes, loading peak, whether the table is memory-mapped) as
    ``loader._read_resident`` holds them."""
    from fate_edge.model.embedding import embedding_bytes

    cfg = load_config(store_dir)
    reader = CheckpointReader(store_dir)
    names = resident_weight_names(cfg, reader)
    width = torch.empty(0, dtype=dtype).element_size()
    numel = {n: _numel(reader.shape(n)) for n in names}
    held_as = {n: numel[n] * (4 if n.endswith(FP32_SUFFIXES) else width) for n in names}
    held_as.update({n: reader.nbytes(n) for n in names if not is_float_weight(n)})  # quantized at convert
    held = loading = 0
    quantized: set[str] = set()
    if resident_bits is not None:
        for group in resident_groups(cfg, layer_names(cfg, reader), set(names)):
            if in_store(reader, group):
                continue
            keys = [f"{n}.weight" for n in group]
            floats = sum(held_as[k] for k in keys)
            weights = sum(numel[k] for k in keys)
            fused = floats if len(keys) > 1 else 0
            loading = max(loading, held + floats + fused + int(_QUANTIZE_BYTES_PER_WEIGHT * weights))
            shapes = [reader.shape(k) for k in keys]
            held += quantized_group_bytes((sum(s[0] for s in shapes), shapes[0][1]), len(group), resident_bits)
            quantized.update(keys)
    embed = 0
    for n in names:
        if n in quantized:
            continue
        if n == EMBEDDING:
            size, converted = embedding_bytes(reader.shape(n), dtype, embedding_bits), 0  # quantized rows as read
        else:  # read, then cast to the compute dtype: both at once
            size = held_as[n]
            converted = reader.nbytes(n) if reader.nbytes(n) != size else 0
        loading = max(loading, held + size + converted)
        held += size
        embed += size if n.startswith(EMBEDDING_PREFIX) else 0
    mapped = any(n.startswith(EMBEDDING_PREFIX) and not is_float_weight(n) for n in names)
    # a table read by row is not held while loading either
    return embed, held - embed, max(loading, held) - (embed if mapped else 0), mapped


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def memory_account(
    store_dir: str | Path,
    budget: int,
    dtype: str | torch.dtype = "bfloat16",
    context_tokens: int = defaults.CONTEXT_TOKENS,
    resident_bits: int | None = None,
    runtime: int | None = None,
    embedding_bits: int | None = None,
    prompt_cache: int | str = 0,
) -> MemoryAccount:
    """The account of an Engine on ``store_dir`` with expert budget ``budget``, serving up to ``context_tokens``
    (prompt and answer), its embedding table held at ``embedding_bits`` (None: ``dtype``), with a prompt cache of
    ``prompt_cache`` (``prompt_cache.prompt_cache_room``; 0: none); ``runtime``: the process's own bytes (default: its
    RSS now, imports done)."""
    from fate_edge.runtime.prompt_cache import prompt_cache_room

    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    store_dir = Path(store_dir)
    cfg = load_config(store_dir)
    embed, other, loading, mapped = _weights(store_dir, dtype, resident_bits, embedding_bits)
    per_token, fixed = kv_shape(cfg, dtype, context_tokens)
    kv = per_token * max(64, context_tokens) + fixed
    room = prompt_cache_room(prompt_cache, per_token, max(64, context_tokens), fixed)
    heap = is_store(store_dir) and views_only(ExpertStore(store_dir))  # runtime.prompt_heap
    return MemoryAccount(
        current_rss_bytes() if runtime is None else runtime,
        embed,
        other,
        int(budget),
        kv,
        buffer_bytes(cfg, dtype, min(context_tokens, PREFILL_CHUNK), heap),
        loading,
        context_tokens,
        mapped,
        room,
    )


def available_memory_bytes() -> int:
    """Memory this process can still take: the kernel's MemAvailable, or less inside a memory cgroup (v2) whose
    limit is nearer (a container, ``systemd-run -p MemoryMax=``)."""
    import psutil

    free = int(psutil.virtual_memory().available)
    try:
        with open("/proc/self/cgroup") as f:
            path = next((line.split(":", 2)[2].strip() for line in f if line.startswith("0::")), None)
        if path is not None:
            group = Path("/sys/fs/cgroup") / path.lstrip("/")
            limit = (group / "memory.max").read_text().strip()
            if limit != "max":
                free = min(free, int(limit) - int((group / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return free


def shortfall(account: MemoryAccount, free: int) -> str | None:
    """Why a run with ``account`` cannot fit ``free`` bytes beyond what the process holds now, or None. One line,
    in MB, naming the parts and what to lower."""
    need = account.to_load
    if need <= free:
        return None
    over = account.running - free
    if account.loading > free:
        fix = (
            "loading the resident weights alone takes more: hold them in fewer bits (--resident-bits 4, from a "
            "store converted with --resident-bits 4) or free memory"
        )
    elif account.expert_budget > over:
        fix = f"lower --memory-budget to {(account.expert_budget - over) / 1e6:.0f} MB or free memory"
    else:
        fix = (
            "without any expert budget the resident weights, KV cache and buffers still do not fit: hold the "
            "weights in fewer bits (--resident-bits 4, --embedding-bits 4) or free memory"
            + (f"; --prompt-cache 0 frees {account.prompt_cache / 1e6:.0f} MB" if account.prompt_cache else "")
        )
    held = max(account.loading, account.running)
    return (
        f"this run needs {need / 1e6:.0f} MB beyond the {account.runtime / 1e6:.0f} MB the runtime holds "
        f"(embeddings {account.embeddings_held / 1e6:.0f} + other resident weights {account.other_resident / 1e6:.0f}"
        f" + expert budget {account.expert_budget / 1e6:.0f} + KV cache {account.kv_cache / 1e6:.0f} at "
        f"{account.context_tokens} tokens + prompt cache {account.prompt_cache / 1e6:.0f} + buffers "
        f"{account.buffers / 1e6:.0f} MB"
        + ("" if held == account.running else f"; loading holds {account.loading / 1e6:.0f} MB")
        + f") but only {free / 1e6:.0f} MB is free; {fix}"
    )
