"""Expert weights and the ExpertProvider interface the MoE block obtains them through.

The MoE block never touches a checkpoint: it asks a provider for expert (layer, index) and calls it.
This issue ships two providers (all experts in memory, or each read from the safetensors files on
demand); the expert store, the fetch engine and the cache plug in behind the same interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeAlias

import torch
import torch.nn.functional as F

from fate_edge.model.versioned_dict import VersionedDict
from fate_edge.quant import QuantSpec
from fate_edge.quant.linear import QuantizedLinear, candidate_kernels, choose_kernel
from fate_edge.quant.mxfp4 import Mxfp4Linear
from fate_edge.quant.native import rows_of_four_pay


@dataclass(frozen=True)
class Glu:
    """The gated activation between an expert's two matmuls: ``silu(gate) * up``, or with ``limit`` gpt-oss's clamped
    SwiGLU, ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``."""

    limit: float | None = None
    alpha: float = 1.702

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.limit is None:
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))  # the reference's order of operations


SILU = Glu()


@dataclass
class ExpertBias:
    """An expert's biases (gpt-oss), kept in full precision whatever its matrices are stored in: ``gate_up`` [2I]
    (gate's then up's) and ``down`` [H]."""

    gate_up: torch.Tensor
    down: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.gate_up, self.down))

    def to(self, device: str | torch.device) -> ExpertBias:
        return ExpertBias(self.gate_up.to(device), self.down.to(device))


def plus_bias(y: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``y + b`` in ``y``'s dtype (a full-precision bias on a bf16 kernel's output rounds once, into its dtype)."""
    if b is None:
        return y
    return y.add_(b) if b.dtype == y.dtype else y.add_(b.to(y.dtype))


@dataclass
class ExpertWeights:
    """One SwiGLU expert: ``down(act(gate(x)) * up(x))`` (``glu``: the activation and product; ``bias``: gpt-oss's
    biases on both matmuls).

    With ``gate_up`` [2I, H] (what :meth:`fused` builds), ``gate`` and ``up`` are views into it and the
    expert runs two matmuls instead of three.
    """

    gate: torch.Tensor  # [I, H]
    up: torch.Tensor  # [I, H]
    down: torch.Tensor  # [H, I]
    gate_up: torch.Tensor | None = None
    bias: ExpertBias | None = None
    glu: Glu = SILU

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [N, H] -> [N, H]
        b = self.bias
        if self.gate_up is not None:
            gate, up = F.linear(x, self.gate_up, None if b is None else b.gate_up).chunk(2, dim=-1)
        elif b is None:
            gate, up = F.linear(x, self.gate), F.linear(x, self.up)
        else:
            gb, ub = b.gate_up.chunk(2)
            gate, up = F.linear(x, self.gate, gb), F.linear(x, self.up, ub)
        return F.linear(self.glu(gate, up), self.down, None if b is None else b.down)

    @classmethod
    def fused(
        cls, gate_up: torch.Tensor, down: torch.Tensor, bias: ExpertBias | None = None, glu: Glu = SILU
    ) -> ExpertWeights:
        gate, up = gate_up.chunk(2, dim=0)
        return cls(gate, up, down, gate_up, bias, glu)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.bias is None else self.bias.nbytes
        return sum(t.numel() * t.element_size() for t in (self.gate, self.up, self.down)) + extra

    def to(self, device: str | torch.device) -> ExpertWeights:
        if self.gate.device == torch.device(device):
            return self
        bias = None if self.bias is None else self.bias.to(device)
        if self.gate_up is not None:
            return ExpertWeights.fused(self.gate_up.to(device), self.down.to(device), bias, self.glu)
        return ExpertWeights(self.gate.to(device), self.up.to(device), self.down.to(device), None, bias, self.glu)


class QuantizedExpert:
    """A SwiGLU expert whose matrices are quantized (see ``quant.linear``): gate, up, down, or gate_up and down."""

    def __init__(self, gate, up, down, gate_up=None, bias: ExpertBias | None = None, glu: Glu = SILU):
        self.gate, self.up, self.down, self.gate_up = gate, up, down, gate_up
        self.bias, self.glu = bias, glu  # gpt-oss: full-precision biases, the clamped SwiGLU
        # Every matrix on torch's int4 kernel: computed in bf16 (forward_bf16) and stackable for the one-graph decode
        # steps (compiled_step).
        self.takes_bf16 = all(m.kernel == "torch-int4" for m in (gate, up, down, gate_up) if m is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.takes_bf16 and x.dtype == torch.bfloat16:  # the kernel's own dtype: skip its no-op casts
            return self.forward_bf16(x)
        b = self.bias
        if self.gate_up is not None:
            gate, up = plus_bias(self.gate_up(x), None if b is None else b.gate_up).chunk(2, dim=-1)
        else:
            gate, up = self.gate(x), self.up(x)
            if b is not None:
                gate, up = plus_bias(torch.cat([gate, up], dim=-1), b.gate_up).chunk(2, dim=-1)
        return plus_bias(self.down(self.glu(gate, up)), None if b is None else b.down)

    def forward_bf16(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [N, H] bf16 → [N, H] bf16 (``takes_bf16`` only): the kernel's own dtype, no casts between (what a
        decode row runs, ``layer_step.expert_rows``: about half the time of ``__call__`` on float32 rows, whose kernel
        casts in and out at every matmul; docs/measured-choices.md)."""
        b = self.bias
        if self.gate_up is not None:
            gate, up = plus_bias(self.gate_up.mm_bf16(x), None if b is None else b.gate_up).chunk(2, dim=-1)
        else:
            gate, up = self.gate.mm_bf16(x), self.up.mm_bf16(x)
            if b is not None:
                gate, up = plus_bias(torch.cat([gate, up], dim=-1), b.gate_up).chunk(2, dim=-1)
        return plus_bias(self.down.mm_bf16(self.glu(gate, up)), None if b is None else b.down)

    def fused(self) -> QuantizedExpert:
        """This expert with gate and up as one matrix (one matmul fewer per call), when both are torch-int4 on the
        CPU or both native-int4: each layout keeps rows apart, so stacking packed rows and their scales is the
        layout of the stacked matrix. Every part is copied, so a blob behind the views is freed."""
        g, u = self.gate, self.up
        if self.gate_up is None and all(isinstance(m, Mxfp4Linear) for m in (g, u, self.down)):  # MXFP4 rows too
            down = Mxfp4Linear(self.down.blocks.clone(), self.down.scales.clone(), self.down.kernel)
            return QuantizedExpert(None, None, down, g.stacked(u), self.bias, self.glu)
        if (
            self.gate_up is None
            and g.native is not None
            and u.native is not None
            and g.spec == u.spec
            and self.down.native is not None
        ):  # the portable layout keeps rows apart too
            gate_up = QuantizedLinear.from_native(
                *(torch.cat([a, b]) for a, b in zip(g.native.parts, u.native.parts)), g.spec, in_features=g.shape[1]
            )
            down = QuantizedLinear.from_native(
                *(t.clone() for t in self.down.native.parts), g.spec, in_features=self.down.shape[1]
            )
            return QuantizedExpert(None, None, down, gate_up, self.bias, self.glu)
        if self.gate_up is not None or not self.takes_bf16 or g.spec != u.spec:
            return self
        packed = torch.cat([g.packed, u.packed])
        scale_zero = torch.cat([g.scale_zero, u.scale_zero], dim=1)
        if g.packed.device.type != "cpu":  # CUDA's tinygemm layout tiles rows by 8: checked once per shape
            gate_up = QuantizedLinear(
                g.spec, (g.shape[0] + u.shape[0], g.shape[1]), "torch-int4", packed, scale_zero=scale_zero
            )
            if not _stacks_rows(g, u, gate_up):
                return self
            down = QuantizedLinear(
                g.spec, self.down.shape, "torch-int4", self.down.packed.clone(), scale_zero=self.down.scale_zero.clone()
            )
            return QuantizedExpert(None, None, down, gate_up, self.bias, self.glu)
        gate_up = QuantizedLinear.from_kernel_layout(packed, scale_zero, g.spec)
        down = QuantizedLinear.from_kernel_layout(self.down.packed.clone(), self.down.scale_zero.clone(), g.spec)
        return QuantizedExpert(None, None, down, gate_up, self.bias, self.glu)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.bias is None else self.bias.nbytes
        return sum(m.nbytes for m in (self.gate, self.up, self.down, self.gate_up) if m is not None) + extra

    @property
    def kernel(self) -> str:
        return (self.gate_up if self.gate_up is not None else self.gate).kernel


def into_rows_of_four(expert: object) -> None:
    """An expert kept for the whole run (a cache that holds the model): its native int4 matrices into rows of four
    where that pays here (``quant.native.rows_of_four_pay``), rewritten in place in its blob."""
    if not isinstance(expert, QuantizedExpert) or not rows_of_four_pay():
        return
    for m in (expert.gate, expert.up, expert.down, expert.gate_up):
        native = getattr(m, "native", None)
        if native is not None:
            native.interleave_rows()


# A routed expert as providers hand it out: called on the gate input [N, H] -> [N, H].
Expert: TypeAlias = ExpertWeights | QuantizedExpert

_ROW_STACKING: dict[tuple, bool] = {}  # (device type, gate shape, up shape, group) → fused gate_up is exact


def _stacks_rows(g: QuantizedLinear, u: QuantizedLinear, gate_up: QuantizedLinear) -> bool:
    """Whether stacking ``g`` and ``u``'s packed rows gave the matrix of both (a device kernel's layout may tile
    rows): checked once per shape on a random input, exact or not at all."""
    key = (g.packed.device.type, g.shape, u.shape, g.spec.group_size)
    if key not in _ROW_STACKING:
        x = torch.randn(2, g.shape[1], generator=torch.Generator().manual_seed(0)).to(g.packed.device, torch.bfloat16)
        _ROW_STACKING[key] = torch.equal(gate_up.mm_bf16(x), torch.cat([g.mm_bf16(x), u.mm_bf16(x)], dim=-1))
    return _ROW_STACKING[key]


class ExpertProvider(ABC):
    """Where the MoE block gets routed experts from: the whole contract the model relies on.

    Per MoE layer the model calls :meth:`stream_groups` once with the experts it needs (most popular first),
    computes each group as it arrives, then calls :meth:`end_layer`. A provider only has to implement
    :meth:`get`; the scheduler overrides :meth:`stream_groups` (cache hits together, then reads as they land) and
    :meth:`end_layer` (unpin, drop unused prefetches).
    """

    # Whether stream_groups hands out every expert asked for at once, in one group, without waiting for a read (or
    # waits only for an expert's first use: a cache that holds the whole model): the MoE block may then compute the
    # shared expert in the same kernel calls (grouped_experts.group_rows_with_shared) instead of beside the reads it
    # would otherwise overlap
    all_at_hand = False

    @abstractmethod
    def get(self, layer: int, expert: int) -> Expert:
        """The weights of ``expert`` in ``layer``, ready to call."""

    def stream(self, layer: int, expert_ids: Iterable[int]) -> Iterator[tuple[int, Expert | None]]:
        """Yield (expert id, callable expert, or None when the provider chose to skip it), in any order."""
        for e in expert_ids:
            yield e, self.get(layer, e)

    def stream_groups(self, layer: int, expert_ids: Iterable[int]) -> Iterator[list[tuple[int, Expert | None]]]:
        """:meth:`stream` in groups the caller may compute together (one kernel call for several experts): each
        group's experts stay valid until the caller asks for the next group. By default one expert a group."""
        for item in self.stream(layer, expert_ids):
            yield [item]

    def end_layer(self, layer: int) -> None:  # noqa: B027 (optional hook, nothing to release by default)
        """The MoE block has computed every expert of ``layer``."""

    def resident_token(self) -> object | None:
        """Where every expert is in memory now and stays there, handed out without a read, until the returned token
        changes (compared with ``==``): the token; else None (the default). A decode row may then compute a whole
        layer in one native call (``fate_edge.model.decode_layer``) with the experts :meth:`resident_layer` gave."""
        return None

    def resident_layer(self, layer: int, num_experts: int) -> list[Expert] | None:
        """Every expert of ``layer`` in id order while :meth:`resident_token` is not None (None: not all held)."""
        return None

    def served_resident(self, layer: int, ids: list[int], seconds: float) -> None:  # noqa: B027 (optional hook)
        """``layer``'s experts ``ids`` (ascending) were computed in one native call from :meth:`resident_layer`'s
        experts, in ``seconds``: what :meth:`stream_groups` and :meth:`end_layer` would have noted."""

    @property
    def serves_cached_layers(self) -> bool:
        """Whether :meth:`take_cached` may hand a decode row's experts out (a cache under a budget)."""
        return False

    def cached_layer(self, layer: int) -> dict[int, Expert]:
        """The experts of ``layer`` held in memory now (id → expert), where :attr:`serves_cached_layers`."""
        return {}

    def take_cached(
        self, layer: int, ids: list[int], accept: Callable[[dict[int, Expert]], bool]
    ) -> list[Expert] | None:
        """``layer``'s experts ``ids`` (ascending) where every one is held now and ``accept`` takes them (id → expert),
        noted as used as :meth:`stream_groups` would (then :meth:`served_cached`), else None and nothing noted."""
        return None

    def served_cached(self, layer: int, count: int, seconds: float) -> None:
        """:meth:`take_cached`'s experts were computed, in ``seconds``: as :meth:`end_layer` after their groups."""
        self.end_layer(layer)

    def begin_forward(self, tokens: int, sequences: int = 1) -> None:  # noqa: B027 (optional hook)
        """A forward pass over ``tokens`` new positions per sequence starts: a prompt when more than one, even
        where a layer then routes fewer rows (the last layer of a prompt asked for its last logits only).
        ``sequences``: how many sequences the pass carries (a batched decode step routes one row per sequence)."""


_SERVING = ("get", "stream", "stream_groups", "end_layer")  # how a provider hands experts to the MoE block


class InMemoryExpertProvider(ExpertProvider):
    """Every expert resident in memory: the reference configuration for parity and the fastest when it fits."""

    all_at_hand = True

    def __init__(self, experts: dict[tuple[int, int], Expert]):
        # Resident int4 experts with separate gate and up (as the store holds them) take one matmul for both.
        self.experts = {k: e.fused() if isinstance(e, QuantizedExpert) else e for k, e in experts.items()}
        for e in self.experts.values():  # kept for the whole run
            into_rows_of_four(e)

    @property
    def experts(self) -> VersionedDict:
        """Every expert by (layer, expert): a dict that counts its changes, so a whole-layer program made from them
        is made again after one (:meth:`resident_token`)."""
        return self._experts

    @experts.setter
    def experts(self, experts: dict[tuple[int, int], Expert]) -> None:
        self._experts = VersionedDict(experts)
        self._token = object()  # a new set of experts: a new resident token

    @classmethod
    def quantized(
        cls,
        provider: InMemoryExpertProvider,
        spec: QuantSpec,
        device: str | torch.device = "cpu",
        kernel: str | None = None,
    ) -> InMemoryExpertProvider:
        """Every expert of ``provider`` quantized (round-to-nearest) and kept resident: gate_up and down.

        ``kernel`` None: the fastest here per matrix shape, timed once (``quant.linear.choose_kernel``)."""
        out: dict[tuple[int, int], Expert] = {}
        for key, e in provider.experts.items():
            if not isinstance(e, ExpertWeights):
                raise TypeError(f"expert {key} is quantized already")
            out[key] = quantize_expert(e, spec, device, kernel)
        return cls(out)

    def get(self, layer: int, expert: int) -> Expert:
        return self.experts[(layer, expert)]

    def resident_token(self) -> object | None:
        cls = type(self)
        if cls is not InMemoryExpertProvider and any(
            getattr(cls, name) is not getattr(InMemoryExpertProvider, name) for name in _SERVING
        ):
            return None  # a subclass that serves its experts its own way sees each layer's groups
        # not ``self``: a program keyed on it would keep the provider alive
        return self._token, self._experts.version

    def resident_layer(self, layer: int, num_experts: int) -> list[Expert] | None:
        held = [self.experts.get((layer, e)) for e in range(num_experts)]
        return None if any(e is None for e in held) else held  # type: ignore[return-value]

    def stream_groups(self, layer: int, expert_ids: Iterable[int]) -> Iterator[list[tuple[int, Expert | None]]]:
        yield list(self.stream(layer, expert_ids))  # all resident: one group


# Row counts expert kernels are timed at: a decode token, and an expert's share of a prefill chunk (64 tokens,
# top-8 of 64 experts: 8 rows); ``quant.linear.pick_for_rows`` keeps a kernel that wins one only if it holds the other.
EXPERT_ROWS = (1, 8)


def quantize_expert(
    e: ExpertWeights, spec: QuantSpec, device: str | torch.device = "cpu", kernel: str | None = None
) -> QuantizedExpert:
    """Round-to-nearest ``e``; gate and up become one matrix (rows quantize independently: same codes).
    ``kernel`` None: per matrix shape, the kernel timed fastest here at :data:`EXPERT_ROWS` rows."""
    gate_up = e.gate_up if e.gate_up is not None else torch.cat([e.gate, e.up])
    dev = torch.device(device)

    def pick(w: torch.Tensor) -> str:  # a requested kernel that cannot take this shape: the fastest that can
        if kernel is not None and (kernel == "dequant" or kernel in candidate_kernels(tuple(w.shape), spec, dev)):
            return kernel
        return choose_kernel(w, spec, dev, rows=EXPERT_ROWS)

    gu, down = (QuantizedLinear.from_float(w, spec, device, pick(w)) for w in (gate_up, e.down))
    bias = None if e.bias is None else e.bias.to(dev)
    return QuantizedExpert(None, None, down, gu, bias, e.glu)
