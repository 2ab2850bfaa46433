"""Per-layer weights the forward pass reads, fused into fewer and larger matmuls.

q/k/v become one matrix, a dense MLP's (or shared expert's) gate and up one matrix (with Qwen's shared-expert
gate as its last row). Fusing concatenates once; the checkpoint names in ``Weights`` then point at views into
the fused tensor, so memory does not grow and ``model.w[name]`` still reads the checkpoint's tensor.
Assigning or deleting a name bumps ``Weights.version`` and the plan is rebuilt from the dict on the next call.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from fate_edge.errors import ModelFormatError
from fate_edge.huge_pages import on_huge_pages
from fate_edge.model import head_matvec, row_ops
from fate_edge.model.arch.base import ModelConfig
from fate_edge.model.versioned_dict import VersionedDict
from fate_edge.quant import QuantSpec, quantize
from fate_edge.quant.block_order import resident_block_rows_name, resident_lacks_block_order
from fate_edge.quant.int8 import Int8Linear, quantize_int8
from fate_edge.quant.linear import QuantizedLinear, default_kernel, host_int4_block_rows, int4_supported
from fate_edge.quant.native import padded_in_features, rows_of_four_pay
from fate_edge.quant.pack import pack

if TYPE_CHECKING:
    from fate_edge.model.embedding import QuantizedEmbedding


class Weights(VersionedDict):
    """Resident weights by checkpoint name; every change bumps ``version`` (the plan is made again)."""

    # Stored tensors that can also be read by row from their file (a memory-mapped embedding table's parts; set by
    # the loader): name -> a ``RowSource``
    row_sources: dict[str, Any] | None = None
    # Native int4 codes rewritten in place in rows of four by a plan (:func:`_quantized`): key -> a weak reference to
    # the codes tensor, so a tensor put in its place later is read as the portable layout it is
    rows4: dict[str, weakref.ref] | None = None

    def __deepcopy__(self, memo: dict) -> Weights:
        """A copy whose :attr:`rows4` names its own copies of the codes it lists (a weak reference would still point
        at the original's, and the copy would read its rewritten codes as the portable layout)."""
        out = Weights()
        memo[id(self)] = out
        for k, v in self.items():
            dict.__setitem__(out, k, copy.deepcopy(v, memo))
        out.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items() if k != "rows4"})
        if self.rows4:
            alive = ((k, r()) for k, r in self.rows4.items())
            out.rows4 = {k: weakref.ref(memo[id(t)]) for k, t in alive if t is not None and id(t) in memo}
        return out


@dataclass
class Fused:
    """``F.linear(x, weight, bias)`` whose output splits into ``sizes`` (one per member matrix)."""

    weight: Any  # a tensor, or a callable quantized linear (``bias`` then None)
    bias: torch.Tensor | None
    sizes: list[int]


@dataclass
class LayerPlan:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Fused | None  # GQA attention; None for MLA (its projections are in ``mla``)
    o_proj: Fused
    q_norm: torch.Tensor | None  # GQA's q norm (config.qk_norm), or MLA's q_a_layernorm (None: no q LoRA)
    k_norm: torch.Tensor | None  # GQA's k norm, or MLA's kv_a_layernorm
    mlp: Fused | None  # dense MLP or shared expert: [gate; up(; shared gate row)]
    down: Fused | None
    router: torch.Tensor | None  # MoE layers
    correction_bias: torch.Tensor | None
    mla: dict[str, Fused] = field(default_factory=dict)  # MLA's projections by name (q_proj, kv_b_proj, ...)
    sinks: torch.Tensor | None = None  # gpt-oss: each head's sink logit [heads] (attention.sink_attention)
    router_bias: torch.Tensor | None = None  # gpt-oss: the router's bias [E]
    # A recurrent mixer's weights (config.mixer: "conv", "linear_attention"; fate_edge.model.recurrent): its input
    # projections by role, and its other tensors by checkpoint suffix (the convolution's weight [C, 1, K], ...)
    mixer: str = "attention"
    mix_in: dict[str, Fused] = field(default_factory=dict)
    mix: dict[str, torch.Tensor] = field(default_factory=dict)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the reference models compute it (in float32, then scaled in the input's dtype)."""
    dtype = x.dtype
    if dtype == torch.float32 and weight.dtype == torch.float32:  # one fused kernel, bit-identical in fp32
        return F.rms_norm(x, weight.shape, weight, eps)
    # F.rms_norm without a weight: h * rsqrt(mean(h^2) + eps) in one operator where the formula took five, with
    # the same bits (as in float32 above); a decode token runs two a layer
    if weight.dtype == torch.float32:  # held in float32 (Qwen3-Next's 1 + weight): scaled there, rounded once
        return (F.rms_norm(x.float(), weight.shape, None, eps) * weight).to(dtype)
    if dtype == torch.bfloat16:  # a decode row: one native call, the same bits (rms_norm_row says which it takes)
        out = row_ops.rms_norm_row(x, weight, eps)
        if out is not None:
            return out
    if dtype in (torch.bfloat16, torch.float16):
        # on a half-precision x, F.rms_norm computes in float32 and rounds once: h.to(dtype)'s bits without the
        # two casts (each operator between the native kernels costs tens of µs in a decode step: docs/cpu-profile.md)
        return weight * F.rms_norm(x, weight.shape, None, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(dtype)


def apply_linear(x: torch.Tensor, f: Fused) -> torch.Tensor:
    """``F.linear`` through a fused (maybe quantized) linear."""
    w = f.weight
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, f.bias)
    y = w(x)  # a quantized linear (resident_bits); padded int4 rows are cut off by FirstRows
    return y if f.bias is None else y + f.bias


def head_logits(x: torch.Tensor, head: Fused) -> torch.Tensor:
    """The output head on rows ``x`` [N, H] → logits [N, V]. One row against a bf16/fp16 matrix on the CPU goes
    through fate-edge's matvec kernel (``head_matvec``: reads the matrix once, in fp32, at the memory's speed where
    torch's one-row bf16 GEMM does not; docs/measured-choices.md); more rows, where torch's GEMM shares each
    weight's read between them, and every other head through :func:`apply_linear`."""
    w = head.weight
    if x.dim() == 2 and x.shape[0] == 1 and head.bias is None and isinstance(w, torch.Tensor) and w.dim() == 2:
        if head_matvec.takes(w[None]):
            return head_matvec.w_x(x[:, None, :], w[None]).view(1, -1).to(x.dtype)
    return apply_linear(x, head)


def fuse(w: Weights, names: list[str]) -> Fused:
    """One matrix for the linears ``names`` (checkpoint prefixes); their weights become views into it.

    If :func:`quantize_group` quantized this group, the fused matrix is its quantized linear."""
    key = "+".join(names)
    biases = [w.get(f"{n}.bias") for n in names]
    quantized = _quantized(w, key)
    if quantized is not None:
        weight, sizes = quantized
    else:
        weights = [w[f"{n}.weight"] for n in names]
        sizes = [t.shape[0] for t in weights]
        weight = weights[0] if len(names) == 1 else _concat(w, [f"{n}.weight" for n in names], weights)
    if all(b is None for b in biases):
        return Fused(weight, None, sizes)
    if len(names) == 1:
        return Fused(weight, biases[0], sizes)
    like = next(b for b in biases if b is not None)
    filled = [b if b is not None else like.new_zeros(size) for b, size in zip(biases, sizes)]
    return Fused(weight, _concat(w, [f"{n}.bias" for n in names], filled), sizes)


def _quantized(w: Weights, key: str) -> tuple[Any, list[int]] | None:
    if f"{key}.int8" in w:
        return Int8Linear(w[f"{key}.int8"], w[f"{key}.int8_scale"]), w[f"{key}.sizes"].tolist()
    if f"{key}.nint4" in w:
        spec = QuantSpec(4, int(w[f"{key}.int4_group"]))
        codes = w[f"{key}.nint4"]
        held = (getattr(w, "rows4", None) or {}).get(key)
        lin = QuantizedLinear.from_native(
            codes,
            w[f"{key}.nint4_scale"],
            w[f"{key}.nint4_zero"],
            spec,
            in_features=int(w[f"{key}.in_features"]),
            rows4=held is not None and held() is codes,
        )
        _into_rows_of_four(w, key, codes, lin)
        return lin, w[f"{key}.sizes"].tolist()
    if f"{key}.int4" in w:
        spec = QuantSpec(4, int(w[f"{key}.int4_group"]))
        # torch's CPU int4 layout depends on the packing CPU's ISA: re-packed where this CPU's order differs
        lin = QuantizedLinear.from_cpu_kernel_layout(
            w[f"{key}.int4"], w[f"{key}.int4_scale_zero"], spec, "cpu", rows=_block_rows(w, key)
        )
        sizes = w[f"{key}.sizes"].tolist()
        return (lin if sum(sizes) == lin.shape[0] else FirstRows(lin, sum(sizes))), sizes
    return None


def _into_rows_of_four(w: Weights, key: str, codes: torch.Tensor, lin: QuantizedLinear) -> None:
    """A resident matrix's codes into rows of four where that pays here (``quant.native.rows_of_four_pay``): the
    one-row kernel then streams them as one run. Rewritten in place (no second copy of the model), so ``w`` notes
    which tensor it rewrote; codes the kernel copied (padded, or not contiguous) are its own and noted nowhere. A plain
    dict of weights cannot note it: its codes stay as they are."""
    native = lin.native
    if native is None or native.rows4 or codes.device.type != "cpu" or not rows_of_four_pay():
        return
    own = native.codes is not codes
    if not own and not isinstance(w, Weights):
        return
    native.interleave_rows()
    if not own:
        if w.rows4 is None:
            w.rows4 = {}
        w.rows4[key] = weakref.ref(codes)


def _block_rows(w: Weights, key: str) -> int:
    """The CPU block order ``key``'s int4 codes were packed in (quantize_group records it). Resident weights
    pre-quantized before it was recorded are refused: on a CPU of the other order they decode wrong."""
    if resident_lacks_block_order(w, key):
        raise ModelFormatError(
            f"resident weight {key} is in torch's CPU int4 layout without the CPU block order it was packed in (a "
            "store from before fate-edge recorded it); re-run fate-edge convert"
        )
    return int(w[resident_block_rows_name(key)])


@dataclass
class FirstRows:
    """A quantized linear whose weight was padded with zero rows for its kernel: its first ``rows`` outputs."""

    linear: Any
    rows: int

    def __getattr__(self, name: str) -> Any:  # kernel, shape (padded), nbytes...: the padded linear's
        if name in ("linear", "rows"):  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.linear, name)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)[..., : self.rows]


def _concat(w: Weights, keys: list[str], parts: list[torch.Tensor]) -> torch.Tensor:
    base = parts[0]._base
    if base is not None and _are_consecutive_rows(base, parts):
        return base  # fused before (this plan is a rebuild): reuse, no copy
    fused = torch.cat(parts)
    start = 0
    for key, t in zip(keys, parts):
        if key in w:
            dict.__setitem__(w, key, fused[start : start + t.shape[0]])  # a view: no version bump, no copy kept
        start += t.shape[0]
    return fused


def _are_consecutive_rows(base: torch.Tensor, parts: list[torch.Tensor]) -> bool:
    offset = base.storage_offset()
    for t in parts:
        if t._base is not base or t.storage_offset() != offset or not t.is_contiguous():
            return False
        offset += t.numel()
    return offset == base.storage_offset() + base.numel()


def layer_groups(config: ModelConfig, i: int, n: Any) -> dict[str, list[str]]:
    """The fused linears of decoder layer ``i`` (``n``: its LayerNames), by role."""
    a, groups = n.attn, {"o_proj": [f"{n.attn}.o_proj"]}
    kind = config.mixer(i)
    if kind == "conv":  # LFM2's short convolution: in_proj [B; C; x], out_proj
        groups = {"o_proj": [f"{a}.out_proj"], "mix.in_proj": [f"{a}.in_proj"]}
    elif kind == "linear_attention":  # Qwen3-Next's gated DeltaNet (Qwen3.5: its four input projections as one)
        groups = {"o_proj": [f"{a}.out_proj"]}
        for role, names in delta_projections(config).items():
            groups[f"mix.{role}"] = [f"{a}.{n}" for n in names]
    elif kind != "attention":
        raise ValueError(f"layer {i}: unknown token mixer {kind!r}")
    elif config.mla is None:
        groups["qkv"] = [f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"]
    else:  # MLA: each projection alone (latent norms sit between them), in LayerPlan.mla
        m = config.mla
        for proj in (["q_proj"] if m.q_lora_rank is None else ["q_a_proj", "q_b_proj"]) + [
            "kv_a_proj_with_mqa",
            "kv_b_proj",
        ]:
            groups[f"mla.{proj}"] = [f"{a}.{proj}"]
    if not config.is_moe_layer(i):
        groups["mlp"], groups["down"] = [f"{n.mlp}.gate_proj", f"{n.mlp}.up_proj"], [f"{n.mlp}.down_proj"]
    elif config.shared_expert_intermediate_size:
        shared = f"{n.mlp}.shared_expert" if config.shared_expert_gated else f"{n.mlp}.shared_experts"
        extra = [f"{n.mlp}.shared_expert_gate"] if config.shared_expert_gated else []
        groups["mlp"], groups["down"] = [f"{shared}.gate_proj", f"{shared}.up_proj", *extra], [f"{shared}.down_proj"]
    return groups


def delta_projections(config: ModelConfig) -> dict[str, list[str]]:
    """A DeltaNet layer's input linears by fused role: Qwen3.5's four as one, Qwen3-Next's two."""
    if config.delta is not None and config.delta.split_proj:
        return {"in_proj": ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"]}
    return {"in_proj_qkvz": ["in_proj_qkvz"], "in_proj_ba": ["in_proj_ba"]}


def build_plan(config: ModelConfig, w: Weights, layer_names: list) -> list[LayerPlan]:
    plans = []
    for i, n in enumerate(layer_names):
        g = {role: fuse(w, names) for role, names in layer_groups(config, i, n).items()}
        moe = config.is_moe_layer(i)
        plans.append(
            LayerPlan(
                w[f"{n.input_norm}.weight"],
                w[f"{n.post_attn_norm}.weight"],
                g.get("qkv"),
                g["o_proj"],
                w.get(f"{n.attn}.q_a_layernorm.weight" if config.mla else f"{n.attn}.q_norm.weight"),
                w.get(f"{n.attn}.kv_a_layernorm.weight" if config.mla else f"{n.attn}.k_norm.weight"),
                g.get("mlp"),
                g.get("down"),
                w[f"{n.router}.weight"] if moe else None,
                _correction_bias(w, n.mlp) if moe else None,
                {role.removeprefix("mla."): f for role, f in g.items() if role.startswith("mla.")},
                sinks=w.get(f"{n.attn}.sinks"),
                router_bias=w.get(f"{n.router}.bias") if moe else None,
                mixer=config.mixer(i),
                mix_in={role.removeprefix("mix."): f for role, f in g.items() if role.startswith("mix.")},
                mix=_mixer_tensors(config, w, i, n.attn),
            )
        )
    return plans


def _mixer_tensors(config: ModelConfig, w: Weights, i: int, prefix: str) -> dict[str, torch.Tensor]:
    """A recurrent mixer's tensors other than its linears, by their name under the mixer."""
    names = {
        "conv": ["conv.weight", "conv.bias"],
        "linear_attention": ["conv1d.weight", "dt_bias", "A_log", "norm.weight"],
    }.get(config.mixer(i), [])
    return {n: w[f"{prefix}.{n}"] for n in names if f"{prefix}.{n}" in w}


def _correction_bias(w: Weights, mlp: str) -> torch.Tensor | None:
    """DeepSeek-V3 and GLM keep the selection bias in the router, MiniMax-M2 in the MoE block, ERNIE-4.5 in the
    MoE block's ``moe_statics`` ([1, E])."""
    for name in ("gate.e_score_correction_bias", "e_score_correction_bias", "moe_statics.e_score_correction_bias"):
        if f"{mlp}.{name}" in w:
            return w[f"{mlp}.{name}"].reshape(-1)
    return None


def build_head(w: Weights, embed: torch.Tensor | QuantizedEmbedding) -> Fused:
    """The output projection: lm_head (maybe quantized), or the embedding when they are tied."""
    if "lm_head.weight" in w or _quantized(w, "lm_head") is not None:
        return fuse(w, ["lm_head"])
    # tied to a quantized table (fate_edge.model.embedding): the head multiplies by the same codes
    return Fused(embed if isinstance(embed, torch.Tensor) else embed.as_linear(), None, [embed.shape[0]])


def resident_groups(config: ModelConfig, layer_names: list, names: Any) -> list[list[str]]:
    """The linears :func:`quantize_group` quantizes with ``resident_bits``, one list per fused matrix: lm_head
    first (``names``: the resident weight names; lm_head only where it is one of them), then every layer's groups.

    MLA's ``kv_b_proj`` stays in the model's dtype: decode multiplies by its per-head blocks from the other side
    (the absorbed form, ``mla.attend``), which no quantized kernel does, and expanding the cache through
    it instead costs the whole matrix at every cached position, every token."""
    head = [["lm_head"]] if "lm_head.weight" in names else []
    layers = [g for i, n in enumerate(layer_names) for g in layer_groups(config, i, n).values()]
    return head + [g for g in layers if not g[0].endswith(".kv_b_proj")]


def quantize_group(w: Weights, names: list[str], bits: int) -> None:
    """Quantize one fused group of ``w`` (:func:`resident_groups`: attention, dense MLPs, shared experts, lm_head)
    in place to ``bits``; its float weights go. The loader calls it as each group is read, so a model never holds
    all its float weights at once.

    8: per-channel int8 (torch's int8 kernel); 4: group-wise int4 in torch's CPU layout, rows padded with zeros to
    the kernel's multiple of 16 where needed (Qwen's shared expert gate_up carries its one-row gate: 2I + 1 rows,
    which went to int8, the slowest matmul of a Qwen prefill); :class:`FirstRows` drops the padded outputs.
    Norms, routers, biases and the embedding stay as loaded. Groups the int4 kernel cannot take stay in 8 bits.
    (onnxruntime's MatMulNBits, faster at prefill, is not used: a session per matrix held several times the int4
    bytes; docs/measured-choices.md.)"""
    key = "+".join(names)
    parts = [w[f"{n}.weight"] for n in names]
    full = parts[0] if len(parts) == 1 else torch.cat(parts)  # lm_head alone: no copy
    rows, group = full.shape[0], int4_group(full.shape[1])
    if _native_kernel(tuple(full.shape), bits, full.device):  # any row count; K padded to the kernel's 128
        spec, k = QuantSpec(4, group), full.shape[1]
        if padded_in_features(k) != k:  # zero columns quantize to zero weights (DeepSeek's dense down_proj)
            full = torch.cat([full, full.new_zeros(rows, padded_in_features(k) - k)], dim=1)
        q = quantize(full, spec)
        codes, scale, zero = pack(q.codes, 4), q.scale, q.zero
        del q  # the unpacked codes go before the copy below: no new peak at load
        dict.update(
            w,
            {
                # on huge pages: decode streams them every token, and 4 KB pages cost ~14% of a decode (huge_pages)
                f"{key}.nint4": on_huge_pages(codes),
                f"{key}.nint4_scale": scale,
                f"{key}.nint4_zero": zero,
                f"{key}.int4_group": torch.tensor(group),
                f"{key}.in_features": torch.tensor(k),
            },
        )
    elif _int4_kernel(_padded(tuple(full.shape)), bits, full.device):
        spec = QuantSpec(4, group)
        if rows % _INT4_ROWS:  # Qwen's shared expert: gate + up + its 1-row gate; zero rows, cut off in _quantized
            full = torch.cat([full, full.new_zeros(-rows % _INT4_ROWS, full.shape[1])])
        lin = QuantizedLinear.from_quantized(quantize(full, spec), spec, full.device, "torch-int4")
        dict.update(
            w,
            {
                f"{key}.int4": lin.packed,
                f"{key}.int4_scale_zero": lin.scale_zero,
                f"{key}.int4_group": torch.tensor(group),
                resident_block_rows_name(key): torch.tensor(host_int4_block_rows()),
            },
        )
    else:
        codes, scale = quantize_int8(full)
        dict.update(w, {f"{key}.int8": codes, f"{key}.int8_scale": scale})
    dict.__setitem__(w, f"{key}.sizes", torch.tensor([p.shape[0] for p in parts]))
    del parts, full
    for n in names:
        dict.__delitem__(w, f"{n}.weight")


_INT4_ROWS = 16  # torch's CPU int4 packer wants N % 16 == 0


def _padded(shape: tuple[int, int]) -> tuple[int, int]:
    return (shape[0] + -shape[0] % _INT4_ROWS, shape[1])


def _native_kernel(shape: tuple[int, int], bits: int, device: torch.device) -> bool:
    group = int4_group(shape[1])
    return (
        bits == 4
        and group is not None
        and default_kernel(shape, QuantSpec(4, group), device, copies=True) == "native-int4"
    )


def _int4_kernel(shape: tuple[int, int], bits: int, device: torch.device) -> bool:
    group = int4_group(shape[1])
    return bits == 4 and group is not None and int4_supported(shape, QuantSpec(4, group), device)


def quantized_group_bytes(shape: tuple[int, int], members: int, bits: int) -> int:
    """Bytes :func:`quantize_group` leaves for a fused [N, K] group of ``members`` linears on the CPU: int4 codes
    (N*K/2) + bf16 scale and zero per group of K, or int8 codes + a bf16 scale per row; plus the int64
    bookkeeping (member sizes, the int4 group; torch's layout: its CPU block order)."""
    group = int4_group(shape[1])  # not None where either int4 kernel applies
    if _native_kernel(shape, bits, torch.device("cpu")):  # codes, fp16 scale and zero of K padded; no padded rows
        assert group is not None
        k = padded_in_features(shape[1])
        return shape[0] * k // 2 + (k // group) * shape[0] * 2 * 2 + 8 + 8 + 8 * members
    n, k = _padded(shape)
    if _int4_kernel((n, k), bits, torch.device("cpu")):
        assert group is not None
        return n * k // 2 + (k // group) * n * 2 * 2 + 8 + 8 + 8 * members  # + the group, its block order
    n = shape[0]
    return n * k + n * 2 + 8 * members


def int4_group(k: int) -> int | None:
    """The group a resident linear of input width ``k`` is quantized to int4 in (the largest of 128/64/32 dividing
    it); None: no group divides, and :func:`quantize_group` keeps it in 8 bits."""
    return next((g for g in (128, 64, 32) if k % g == 0), None)
