"""Several routed experts of one layer computed together: where every matrix of a group's int4 experts is on
fate-edge's native kernel, each stage (gate and up, then down) is one call into the kernel for the whole group, the
threads sharing out whole experts (``quant.native.gemm_grouped``), and the activation is one op over every row.

Why: a batched decode step computes the union of its rows' experts, ~23 of 60 a layer on the Qwen1.5-MoE shape at 8
sequences, each on one or two rows. One kernel call per matrix cost a Python call, a ctypes call and an OpenMP
parallel region with its barrier each: with 2 threads on 2 cores (beside the reader thread) the barriers alone took
~27% of the step (py-spy). Each expert's output has the bits of ``expert(x)``: the kernel computes a matrix the same
way whichever thread takes it, and the activation is elementwise.

A decode token's experts all at hand (a resident provider) take the layer's shared expert into the same two calls
(:func:`group_rows_with_shared`): its gate and up beside the routed experts' gate and up, its down beside theirs.
At two threads each call was an OpenMP parallel region the second thread had to be woken for, with the Python
between them serial; one layer's MoE block now enters two regions instead of four (docs/cpu-profile.md). The
shared expert goes first in each call, the largest matrix: the threads take whole matrices in table order, so the
other thread meanwhile takes the routed experts (on the Qwen1.5-MoE shape they read as many bytes as it does).

SiLU-gated int4 experts on bf16 rows (most MoE models) go further: both stages and the activation between them are
one call into the kernel (``quant.native.glu_grouped``), the activation from a table of torch's own bf16 SiLU, so
the bits stay those of the two calls with torch between them; the kernel's tables are built from addresses, not a
view per expert and stage, which cost more Python than the calls saved (docs/measured-choices.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import torch
import torch.nn.functional as F

from fate_edge.model.experts import Expert, QuantizedExpert, plus_bias
from fate_edge.model.layer import Fused
from fate_edge.model.layer_step import ExpertInput, expert_rows
from fate_edge.quant import mxfp4
from fate_edge.quant.linear import QuantizedLinear
from fate_edge.quant.mxfp4 import Mxfp4Linear
from fate_edge.quant.native import NativeInt4, gemm_grouped, glu_grouped

Matrix: TypeAlias = NativeInt4 | Mxfp4Linear  # a stage's matrix: int4 or MXFP4 (gpt-oss) on fate-edge's native kernels


def group_rows(
    group: Sequence[tuple[int, Expert | None]], rows: ExpertInput, parts: dict[int, slice] | None = None
) -> dict[int, torch.Tensor]:
    """Each computed expert of a provider's group (``stream_groups``; None: skipped, left out) on its rows
    (``parts[e]`` of ``rows``, or every row) → its output rows: grouped kernel calls where :func:`groupable`, else
    one :func:`~fate_edge.model.layer_step.expert_rows` each."""
    live = [(e, expert) for e, expert in group if expert is not None]
    items = [(expert, rows.h if parts is None else rows.h[parts[e]]) for e, expert in live]
    if groupable(items):
        return dict(zip((e for e, _ in live), compute_group(items)))
    return {e: expert_rows(expert, rows, None if parts is None else parts[e]) for e, expert in live}


@dataclass
class NativeShared:
    """A shared expert (or dense MLP) both of whose matrices compute on the native kernel (resident int4): what
    :func:`~fate_edge.model.layer_step.shared_out` computes, taken into a group's calls."""

    act: Callable[[torch.Tensor], torch.Tensor]
    gate_up: NativeInt4  # [gate; up(; Qwen's shared gate row)], split by ``sizes``
    sizes: list[int]
    down: NativeInt4


def native_shared(act: Callable[[torch.Tensor], torch.Tensor], mlp: Fused, down: Fused) -> NativeShared | None:
    """``mlp`` and ``down`` as a :class:`NativeShared`, or None where either is not a bias-free matrix on the native
    kernel with every output row its own."""
    first, second = _native_of(mlp), _native_of(down)
    if first is None or second is None or first.shape[0] != sum(mlp.sizes):
        return None
    return NativeShared(act, first, mlp.sizes, second)


def _native_of(f: Fused) -> NativeInt4 | None:
    w = f.weight
    return w.native if isinstance(w, QuantizedLinear) and f.bias is None else None


def native_stages(expert: Expert | None) -> tuple[list[Matrix], Matrix] | None:
    """(the first stage's matrices, ``[gate_up]`` or ``[gate, up]``; down) where every matrix of ``expert`` computes
    on the native int4 kernel, or every one on the native MXFP4 kernel, else None."""
    if not isinstance(expert, QuantizedExpert):
        return None
    first = [expert.gate_up] if expert.gate_up is not None else [expert.gate, expert.up]
    if all(isinstance(m, Mxfp4Linear) and m.kernel == "native-mxfp4" for m in (*first, expert.down)):
        return list(first), expert.down
    mats: list[Matrix | None] = [m.native if m is not None else None for m in (*first, expert.down)]
    if any(m is None for m in mats):
        return None
    *up, down = [m for m in mats if m is not None]
    return up, down


def stages_and_layout(expert: Expert | None) -> tuple[tuple[list[Matrix], Matrix], tuple] | None:
    """(:func:`native_stages`, what experts that group together share: the kind of kernel, the stages' shapes, the
    activation, biases or not), or None; kept on the expert, asked again only if its matrices, biases or activation
    were replaced (a decode token asks it of every expert of every layer)."""
    if not isinstance(expert, QuantizedExpert):
        return None
    mats = (expert.gate_up, expert.gate, expert.up, expert.down, expert.bias, expert.glu)
    held = expert.__dict__.get("_grouping")
    if held is not None and all(a is b for a, b in zip(held[0], mats)):
        return held[1]
    stages = native_stages(expert)
    got = None
    if stages is not None:
        up, down = stages
        kind = type(down)  # int4 and MXFP4 experts in separate groups (no model mixes them)
        got = stages, (kind, len(up), tuple(m.shape for m in up), down.shape, expert.glu, expert.bias is None)
    expert.__dict__["_grouping"] = (mats, got)
    return got


# Most rows a group computes together: a batched decode step's (8 sequences x top-k), not a prompt chunk's. The
# group holds every expert's intermediate rows at once (3 x the intermediate size a row: at most ~11 MB on Mixtral's
# 14336 in fp32, within the memory account's fixed buffer term), where one call each held one expert's; a prompt
# chunk's many rows per expert amortize a call anyway.
GROUP_MAX_ROWS = 64


def groupable(items: Sequence[tuple[Expert | None, torch.Tensor]]) -> bool:
    """Whether :func:`compute_group` takes these (expert, rows) pairs in grouped kernel calls: two or more, every one
    on the native kernel with the same stage layout and intermediate size, rows fp32 or bf16 of one dtype, at most
    :data:`GROUP_MAX_ROWS` rows in all."""
    return _group_stages(items) is not None


Stages = list[tuple[list[Matrix], Matrix]]


def _group_stages(items: Sequence[tuple[Expert | None, torch.Tensor]]) -> Stages | None:
    """Each expert's :func:`native_stages` where the items are :func:`groupable`, else None."""
    if len(items) < 2 or sum(x.shape[0] for _, x in items) > GROUP_MAX_ROWS:
        return None
    dtype = items[0][1].dtype
    if dtype not in (torch.float32, torch.bfloat16):
        return None
    if any(x.dim() != 2 or x.shape[0] == 0 or x.dtype != dtype for _, x in items):
        return None
    return _alike_stages([expert for expert, _ in items])


def _alike_stages(experts: Sequence[Expert | None]) -> Stages | None:
    """Each expert's :func:`native_stages` where every one has them, with one layout (:func:`stages_and_layout`),
    else None."""
    first: tuple | None = None
    all_stages: Stages = []
    for expert in experts:
        got = stages_and_layout(expert)
        if got is None:
            return None
        # compared to the first, not hashed into a set: equal layouts are mostly the same objects, which a tuple's
        # comparison sees at once, where hashing the activation (a dataclass) costs a call each time
        if first is None:
            first = got[1]
        elif got[1] != first:
            return None
        all_stages.append(got[0])
    return all_stages


def group_rows_with_shared(
    group: Sequence[tuple[int, Expert | None]], h: torch.Tensor, shared: NativeShared
) -> tuple[dict[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]] | None:
    """:func:`group_rows` for a group on every row of ``h`` [M, H], with the shared expert ``shared`` on them in the
    same kernel calls → (each computed expert's output rows, the shared expert's output and Qwen's gate logit as
    :func:`~fate_edge.model.layer_step.shared_out` gives them), or None where they cannot be grouped (the caller
    computes them apart)."""
    live = [(e, expert) for e, expert in group if expert is not None]
    items = [(expert, h) for _, expert in live]
    stages = _group_stages(items)
    if stages is None or shared.gate_up.shape[1] != h.shape[1] or not isinstance(stages[0][1], NativeInt4):
        return None  # the shared expert is int4: it joins int4 experts' calls only
    outs, z = _compute(items, (shared, h.contiguous()), stages)
    assert z is not None  # computed with the shared expert
    return dict(zip((e for e, _ in live), outs)), z


def compute_group(items: Sequence[tuple[Expert | None, torch.Tensor]]) -> list[torch.Tensor]:
    """Each expert on its rows x [M, H] → its output rows [M, H] (views of one buffer), as ``expert(x)`` computes
    them. Check :func:`groupable` first."""
    return _compute(items, None)[0]


def _compute(
    items: Sequence[tuple[Expert | None, torch.Tensor]],
    shared: tuple[NativeShared, torch.Tensor] | None,
    stages: Stages | None = None,
) -> tuple[list[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None] | None]:
    """:func:`compute_group`, and ``shared``'s expert on its rows in the same two calls (first in each: the largest
    matrix) → (the experts' outputs, the shared expert's output and gate logit, or None without one). ``stages``:
    each expert's :func:`native_stages`, where the caller has them."""
    if stages is None:
        stages = []
        for expert, _ in items:
            st = native_stages(expert)
            if st is None:
                raise ValueError("compute_group takes experts whose matrices are all on the native kernel (groupable)")
            stages.append(st)
    xs = [x.contiguous() for _, x in items]
    bounds, total = [], 0
    for x in xs:
        bounds.append((total, total + x.shape[0]))
        total += x.shape[0]
    if _fusable(items, xs[0], stages, shared):
        return _compute_fused(xs, bounds, total, stages, shared)
    dtype, device = xs[0].dtype, xs[0].device
    first = [torch.empty(total, m.shape[0], dtype=dtype, device=device) for m in stages[0][0]]
    calls = [(m, x, out[a:b]) for (up, _), x, (a, b) in zip(stages, xs, bounds) for m, out in zip(up, first)]
    if shared is not None:
        s, hs = shared
        s_first = torch.empty(hs.shape[0], s.gate_up.shape[0], dtype=dtype, device=device)
        calls.insert(0, (s.gate_up, hs, s_first))
    _grouped(calls)
    experts = [e for e, _ in items if isinstance(e, QuantizedExpert)]  # every one (native_stages)
    biases = [e.bias for e in experts if e.bias is not None]  # gpt-oss: all or none (groupable)
    for (a, b), bias in zip(bounds, biases):  # each expert's bias on its own rows, as its own call adds it
        if len(first) == 1:
            plus_bias(first[0][a:b], bias.gate_up)
        else:
            gb, ub = bias.gate_up.chunk(2)
            plus_bias(first[0][a:b], gb), plus_bias(first[1][a:b], ub)
    if len(first) == 1:  # gate_up: each row is [gate | up]
        gate, up = first[0].chunk(2, dim=-1)
    else:
        gate, up = first
    act = experts[0].glu(gate, up)  # every row at once: elementwise, the bits each expert's own call gives
    y = torch.empty(total, stages[0][1].shape[0], dtype=dtype, device=device)
    calls = [(down, act[a:b], y[a:b]) for (_, down), (a, b) in zip(stages, bounds)]
    z: tuple[torch.Tensor, torch.Tensor | None] | None = None
    if shared is not None:
        # as shared_out: split_with_sizes, act(gate) * up (a new contiguous tensor), then down
        s_gate, s_up, *gated = s_first.split_with_sizes(s.sizes, dim=-1)
        s_act = (s.act(s_gate) * s_up).contiguous()
        s_y = torch.empty(s_act.shape[0], s.down.shape[0], dtype=dtype, device=device)
        calls.insert(0, (s.down, s_act, s_y))
        z = s_y, (gated[0] if gated else None)
    _grouped(calls)
    for (a, b), bias in zip(bounds, biases):
        plus_bias(y[a:b], bias.down)
    return list(y.split_with_sizes([b - a for a, b in bounds])), z  # one operator for every expert's view


def _fusable(
    items: Sequence[tuple[Expert | None, torch.Tensor]],
    x: torch.Tensor,
    stages: Stages,
    shared: tuple[NativeShared, torch.Tensor] | None,
) -> bool:
    """Whether :func:`_compute_fused` takes the group: bf16 rows, int4 experts without biases, SiLU-gated, and a
    shared expert (if any) SiLU-gated with its gate and up first."""
    up0, down0 = stages[0]
    if x.dtype != torch.bfloat16 or not isinstance(down0, NativeInt4) or x.shape[1] != up0[0].shape[1]:
        return False
    expert = items[0][0]
    if not isinstance(expert, QuantizedExpert) or expert.bias is not None or expert.glu.limit is not None:
        return False  # _group_stages let only groups alike in bias and layout through: the first stands for all
    if shared is not None:
        s = shared[0]
        return s.act is F.silu and len(s.sizes) in (2, 3) and s.sizes[0] == s.sizes[1]
    return True


BF16 = 2  # bytes


def _compute_fused(
    xs: list[torch.Tensor],
    bounds: list[tuple[int, int]],
    total: int,
    stages: Stages,
    shared: tuple[NativeShared, torch.Tensor] | None,
) -> tuple[list[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None] | None]:
    """:func:`_compute` in one call into the kernel (:func:`_fused_call`) → the same outputs as views."""
    return _fused_call(xs, bounds, total, stages, shared).views([b - a for a, b in bounds])


@dataclass
class FusedCall:
    """Where :func:`_fused_call` left its outputs in ``buffer`` (bf16, offsets in elements): the experts' outputs
    ``y`` [total, hidden] row after row, the shared expert's ``shared`` [shared_rows, hidden] (no rows: none), its
    gate logit (None: no gate; one per row, ``shared_width`` apart)."""

    buffer: torch.Tensor
    hidden: int
    y: int
    shared: int
    shared_rows: int
    gate: int | None
    shared_width: int

    def views(self, sizes: list[int]) -> tuple[list[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None] | None]:
        """The experts' outputs as views, ``sizes`` rows each, and the shared expert's output and gate logit (None
        without a shared expert)."""
        buf, hidden = self.buffer, self.hidden
        total = sum(sizes)
        y = buf[self.y : self.y + total * hidden].view(total, hidden)
        z: tuple[torch.Tensor, torch.Tensor | None] | None = None
        if self.shared_rows:
            m = self.shared_rows
            s_y = buf[self.shared : self.shared + m * hidden].view(m, hidden)
            gate = None  # the gate logit: column 2 I of the shared expert's first stage
            if self.gate is not None:
                gate = buf.as_strided((m, 1), (self.shared_width, 1), self.gate)
            z = s_y, gate
        return list(y.split_with_sizes(sizes)), z


def _segments(sizes: list[int]) -> tuple[list[int], int]:
    """Offsets of consecutive buffers of these many bf16 elements, each starting on 64 bytes (the kernels' stores
    stay in whole cache lines, as separate tensors' would) → (offsets, total)."""
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += -(-n // 32) * 32
    return offsets, at


def _fused_call(
    xs: list[torch.Tensor],
    bounds: list[tuple[int, int]],
    total: int,
    stages: Stages,
    shared: tuple[NativeShared, torch.Tensor] | None,
) -> FusedCall:
    """Gate and up, the SiLU product and down for every expert (and ``shared``'s, first in each stage: the largest
    matrix, see :func:`_compute`) in one call into the kernel (``quant.native.glu_grouped``), the same bits as
    :func:`_compute`'s two calls with torch between them. Every intermediate and output in one buffer (one
    allocation a layer, not six); the kernel's tables are built from addresses (a view per expert and stage cost
    more Python than the calls it saves)."""
    ups0, down0 = stages[0]
    width = [m.shape[0] for m in ups0]  # [2I] (one gate_up matrix) or [I, I]
    inter, hidden = sum(width) // 2, down0.shape[0]
    m, s_width, si = 0, 0, 0
    if shared is not None:
        s, hs = shared
        si, m, s_width = s.sizes[0], hs.shape[0], s.gate_up.shape[0]
    sizes = [m * s_width, m * si, m * hidden, *(total * n for n in width), total * inter, total * hidden]
    offsets, elements = _segments(sizes)
    buf = torch.empty(elements, dtype=torch.bfloat16, device=xs[0].device)
    base = buf.data_ptr()
    sp, sa, sy, *rest = (base + BF16 * o for o in offsets)
    fp, ap, yp = rest[: len(width)], rest[len(width)], rest[len(width) + 1]
    rows_first: list[int] = []
    rows_glu: list[int] = []
    rows_down: list[int] = []
    gate = None
    if shared is not None:
        rows_first += s.gate_up.bf16_args(hs.data_ptr(), m, sp)
        rows_glu += [sp, sp + BF16 * si, s_width, si, m, sa]
        rows_down += s.down.bf16_args(sa, m, sy)
        gate = offsets[0] + 2 * si if len(s.sizes) == 3 else None
    for (ups, down), x, (a, b) in zip(stages, xs, bounds):
        rows, xp = b - a, x.data_ptr()
        for mat, first, n in zip(ups, fp, width):
            assert isinstance(mat, NativeInt4)  # _fusable: the group is int4
            rows_first += mat.bf16_args(xp, rows, first + BF16 * a * n)
        if len(width) == 1:  # each row [gate | up]
            g = fp[0] + BF16 * a * 2 * inter
            rows_glu += [g, g + BF16 * inter, 2 * inter, inter, rows, ap + BF16 * a * inter]
        else:
            rows_glu += [fp[0] + BF16 * a * inter, fp[1] + BF16 * a * inter, inter, inter, rows, ap + BF16 * a * inter]
        assert isinstance(down, NativeInt4)
        rows_down += down.bf16_args(ap + BF16 * a * inter, rows, yp + BF16 * a * hidden)
    glu_grouped(rows_first, rows_glu, rows_down)
    return FusedCall(buf, hidden, offsets[-1], offsets[2], m, gate, s_width)


@dataclass
class FusedRow:
    """One decode row's routed experts and shared expert computed in one kernel call (:func:`fused_row_with_shared`),
    not yet added: each expert's output row and the shared expert's (and Qwen's gate logit) as addresses into the
    call's buffer, which this keeps alive, so the sum into the residual (``row_ops.add_expert_rows``) needs no view."""

    call: FusedCall
    ids: list[int]  # the experts, in the order of their output rows

    def address(self, offset: int) -> int:
        return self.call.buffer.data_ptr() + BF16 * offset

    def outputs(self) -> dict[int, int]:
        """Each expert's output row's address."""
        y, hidden = self.call.y, self.call.hidden
        return {e: self.address(y + i * hidden) for i, e in enumerate(self.ids)}

    def tensors(self) -> tuple[dict[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]:
        """The outputs as :func:`group_rows_with_shared` gives them (views), for a residual the native sum does not
        take."""
        ys, z = self.call.views([1] * len(self.ids))
        assert z is not None  # computed with the shared expert
        return dict(zip(self.ids, ys)), z


def fused_row_with_shared(
    group: Sequence[tuple[int, Expert | None]], h: torch.Tensor, shared: NativeShared
) -> FusedRow | None:
    """:func:`group_rows_with_shared` for one row ``h`` [1, H] whose experts all group and fuse (SiLU-gated bf16
    int4, :func:`_fusable`) → the outputs left in the kernel's buffer, or None (the caller takes the general path)."""
    if h.shape[0] != 1 or any(expert is None for _, expert in group):
        return None
    items = [(expert, h) for _, expert in group]
    stages = _group_stages(items)
    if stages is None or shared.gate_up.shape[1] != h.shape[1] or not isinstance(stages[0][1], NativeInt4):
        return None
    h = h.contiguous()
    if not _fusable(items, h, stages, (shared, h)):
        return None
    bounds = [(i, i + 1) for i in range(len(items))]
    return FusedRow(_fused_call([h] * len(items), bounds, len(items), stages, (shared, h)), [e for e, _ in group])


def fused_layer_stages(experts: Sequence[Expert], shared: NativeShared | None, hidden: int) -> Stages | None:
    """Each expert's :func:`native_stages` where a decode row's call of any of them with ``shared`` (or none) fuses
    as :func:`fused_row_with_shared` and :func:`compute_group` fuse it (one layout, int4, SiLU-gated, no biases; a
    SiLU-gated shared expert on rows of ``hidden``), else None: a whole layer's experts checked once
    (``fate_edge.model.decode_layer``)."""
    h = torch.empty(1, hidden, dtype=torch.bfloat16, device="cpu")  # a decode row's kind, for the checks
    items = [(expert, h) for expert in experts]
    stages = _alike_stages(experts)
    if not stages or not isinstance(stages[0][1], NativeInt4):
        return None
    if shared is not None and shared.gate_up.shape[1] != hidden:
        return None
    return stages if _fusable(items, h, stages, None if shared is None else (shared, h)) else None


def _grouped(calls: list[tuple[Matrix, torch.Tensor, torch.Tensor]]) -> None:
    """One grouped call into the kernel of these matrices (one kind: :func:`groupable` keeps them apart)."""
    int4 = [(m, x, y) for m, x, y in calls if isinstance(m, NativeInt4)]
    mx = [(m, x, y) for m, x, y in calls if isinstance(m, Mxfp4Linear)]
    if int4 and mx:
        raise ValueError("one grouped call takes int4 or MXFP4 matrices, not both")
    if mx:
        mxfp4.gemm_grouped(mx)
    else:
        gemm_grouped(int4)
