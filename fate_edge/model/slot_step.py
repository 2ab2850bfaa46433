"""One decode step per token under an expert budget: the expert cache as fixed slots, the step as one CUDA graph.

:class:`SlotGraphDecode` is the decode runner for streamed experts (the scheduler's cache under a budget) where
:class:`~fate_edge.model.graph_step.LayerGraphDecode` replays one graph per layer with a host sync between each.
Every expert the scheduler's cache holds is also in a slot of a slab (one row per slot, the expert's tensors as
its kernel reads them) and the cached expert's own tensors are re-pointed at its slot, so the memory is the slab's
(no second copy). A (layer, expert) → slot table (:class:`~fate_edge.model.slot_table.SlotTable`)
follows the cache: an admission takes a slot, an eviction (the cache's ``on_evict``) frees it.

A token is one replay: every layer's attention, router and shared expert, and its routed experts read from their
slots by the router's ids through the device table (an index op: no host sync). A routed expert with no slot (a
miss) adds nothing: its slot reads as 0 and its weight as 0. The step's routing then comes to the host in one
copy, the token's one sync. Layer by layer, in order, the host hands the routing to the observers (the scheduler
issues its reads, predictors look ahead) and takes the layer's experts through the scheduler (hits counted, misses
read and cached) exactly as eager decode does, up to the first layer that had a miss. Its routing is right (the
layers before it computed with every expert) and its experts are cached now, so they get slots, the table's
changes land on the device in one copy, and the token is run again: a token with a miss costs one more replay and
one more sync per layer it first misses at. The layers already verified route the same on the rerun (same inputs,
same slots) and are not reported twice. Where a miss cannot get a slot (the cache declined it, precision-on-miss
skipped it, or a later admission evicted an earlier layer's expert) the token runs on the eager step instead; where
a cached expert cannot take a slot at all (another format, every slot taken) the model is handed over to the
per-layer graphs for good.

Admissions and evictions happen between replays; on CUDA the copies into the slots run on a copy stream the
compute stream waits on before the next replay. ``capture=False`` runs the same code without graphs: what the CPU
tests check against the eager streamed step (tests/test_slot_step.py). The runner counts its host syncs
(:attr:`SlotGraphDecode.syncs_per_token`).

``in_place=True`` (opt-in, a portable int4 store): the scheduler keeps each expert as its uploaded blob
(``runtime.portable_expert``: nothing re-packed on arrival), a slot holds the blob byte for byte, and a layer's
routed experts are one launch of the Triton kernel that reads the blobs in place (``quant.triton_moe.moe_int4``),
summed in float32 in expert-id order. Checked on the CPU under Triton's interpreter against the eager decode
(tests/test_slot_step_in_place.py); not measured on a GPU.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from fate_edge.errors import BudgetError
from fate_edge.model.compiled_step import static_attention
from fate_edge.model.embedding import lookup
from fate_edge.model.experts import ExpertWeights, QuantizedExpert
from fate_edge.model.graph_step import LayerGraphDecode, _StaticDecode
from fate_edge.model.kv_cache import StaticKV
from fate_edge.model.layer import apply_linear, rms_norm
from fate_edge.model.layer_step import LayerPath, add_moe, add_routed, add_shared, decoder_layer, moe_sum, shared_out
from fate_edge.model.runner import DecodeRunner
from fate_edge.model.slot_table import SlotTable
from fate_edge.quant.triton_moe import Int4MoELayout, MoEScratch, moe_int4, triton_available

if TYPE_CHECKING:
    from fate_edge.model.decoding_model import DecodingModel
    from fate_edge.model.kv_cache import KVCache
    from fate_edge.model.layer import LayerPlan

Part = tuple[Any, str, str]  # (object holding a tensor, its attribute, the slab's name for it)


def slot_parts(expert: Any) -> list[Part] | None:
    """Every tensor a routed expert computes from, as (holder, attribute, slab name); None where the slot step
    cannot compute the expert (another kernel than torch's int4 or dense float, biases, a clamped SwiGLU)."""
    glu_plain = getattr(getattr(expert, "glu", None), "limit", 0) is None
    if not glu_plain or getattr(expert, "bias", 0) is not None:
        return None
    if isinstance(getattr(expert, "blob", None), torch.Tensor) and getattr(expert, "layout", None) is not None:
        return [(expert, "blob", "blob")]  # a portable int4 blob (runtime.portable_expert): copied as it is
    roles = ("gate_up", "down") if getattr(expert, "gate_up", None) is not None else ("gate", "up", "down")
    if isinstance(expert, QuantizedExpert) and expert.takes_bf16:
        return [(getattr(expert, r), a, f"{r}.{a}") for r in roles for a in ("packed", "scale_zero")]
    if isinstance(expert, ExpertWeights):
        return [(expert, r, r) for r in roles]
    return None


def unsupported(model: DecodingModel) -> str | None:
    """Why ``model``'s provider cannot serve a slot step (the cached experts are checked at its first step)."""
    cache = getattr(model.experts, "cache", None)
    if cache is None or not hasattr(model.experts, "stream_groups"):
        return "an expert provider without a cache (the slots follow the scheduler's cache)"
    if getattr(cache, "_other_sizes", None):
        return "a cache with entries of two sizes (fate's full-precision first layer)"
    return None


class SlotGraphDecode(_StaticDecode):
    """The whole decode step as one graph with the routed experts read from slots (experts streamed)."""

    kind = "cuda-slot-graph"

    def __init__(self, model: DecodingModel, capture: bool = True, in_place: bool = False):
        super().__init__(model, capture)
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"the slot decode step does not support {why}")
        self.in_place = in_place  # the portable blobs in the slots, one Triton launch a layer (see the module's doc)
        self.layout: Int4MoELayout | None = None  # the slots' blob layout where in place
        self.scratch: MoEScratch | None = None
        if in_place:
            if not triton_available():
                raise ValueError("the in-place slot step needs Triton (pip install triton, or fate-edge[test])")
            if getattr(model.experts, "zero_copy", False) or getattr(model.experts, "lends", False):
                raise ValueError("the in-place slot step keeps experts as uploaded blobs: not on the CPU's zero-copy")
            model.experts.keeps_blobs = True  # type: ignore[attr-defined]  # the scheduler's (runtime.tier_path)
        self.cache = model.experts.cache  # type: ignore[attr-defined]  # unsupported() checked it
        self.moe_layers = list(model.config.moe_layers)
        self.k = model.config.num_experts_per_tok
        self.num_experts = model.config.num_experts
        self.table: SlotTable | None = None
        self.slab: dict[str, torch.Tensor] = {}
        self.int4_group: int | None = None
        self.glu: Any = None
        self.routing: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # per MoE layer (h, ids, weights)
        self.route_out: torch.Tensor | None = None  # [MoE layers, 2k]: weights then ids (as float32), static
        self.logits: torch.Tensor | None = None
        dev = model.device
        self.copy_stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        # host syncs (routing read-backs) of the last tokens the graph took, and of all of them
        self.syncs_per_token: deque[int] = deque(maxlen=4096)
        self.syncs = 0
        self.reruns = 0  # replays after a miss
        self.eager_tokens = 0  # tokens handed to the eager step (a miss that could not get a slot)
        self.admitted = 0  # experts copied into slots
        self.refused: str | None = None  # why a cached expert could not take a slot (another format, no slot left)

    # ------------------------------------------------------------------ slots
    def _setup(self) -> str | None:
        """The slab, sized from the cache's capacity and the first cached expert; every cached expert admitted.
        Returns why not, or None."""
        first = next(iter(self.cache.entries.values()), None)
        if first is None:
            return "an empty expert cache at the first decode step"
        parts = slot_parts(first.expert)
        if parts is None:
            return f"experts of type {type(first.expert).__name__} on this kernel (torch's int4 or float only)"
        per = max(1, first.nbytes)
        slots = sum(cap // per for cap in self.cache.capacity.values())
        if slots < 1:
            return "an expert budget below one expert"
        with torch.inference_mode(False):  # normal tensors: the cache's evictions update them after the request
            for holder, attr, name in parts:
                t = getattr(holder, attr)
                self.slab[name] = t.new_zeros((slots, *t.shape))
            self.table = SlotTable(slots, self.moe_layers, self.num_experts, self.slab[parts[0][2]].device)
        if isinstance(first.expert, QuantizedExpert):
            self.int4_group = first.expert.down.spec.group_size
        if self.in_place != (parts[0][2] == "blob"):
            return f"cached experts of type {type(first.expert).__name__} with in_place={self.in_place}"
        if self.in_place:
            self.layout, dev = first.expert.layout, self.slab["blob"].device
            self.scratch = MoEScratch.for_layout(self.layout, self.k, min(self.layout.group, 64), dev)
        self.glu = first.expert.glu
        self.table.attach(self.cache)
        return self._sync_slots()

    def _sync_slots(self) -> str | None:
        """A slot for every cached expert that has none (copied in, its tensors re-pointed at the slot); the
        table's changes committed. Returns why an expert cannot take a slot, or None."""
        assert self.table is not None
        new = [key for key in self.cache.entries if key not in self.table]
        if new and self.copy_stream is not None:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.copy_stream.device))
        for key in new:
            why = self._admit(key, self.cache.entries[key].expert)
            if why is not None:
                return why
        self.table.commit()
        return None

    def _admit(self, key: tuple[int, int], expert: Any) -> str | None:
        assert self.table is not None
        parts = slot_parts(expert)
        if parts is None or {name for _, _, name in parts} != set(self.slab):
            return f"expert {key} is not in the slots' format"
        for holder, attr, name in parts:  # every part checked before any is moved
            src, row = getattr(holder, attr), self.slab[name][0]
            if src.shape != row.shape or src.dtype != row.dtype:
                return f"expert {key} has another shape or dtype than the slots ({name}: {tuple(src.shape)})"
        try:
            slot = self.table.admit(key)
        except BudgetError as e:
            return str(e)
        for holder, attr, name in parts:
            src, dst = getattr(holder, attr), self.slab[name][slot]
            if self.copy_stream is not None:
                with torch.cuda.stream(self.copy_stream):
                    dst.copy_(src, non_blocking=True)
                src.record_stream(self.copy_stream)  # its memory is freed below while the copy may be in flight
            else:
                dst.copy_(src)
            setattr(holder, attr, dst)  # the cached expert computes from its slot: its own memory is freed
        if isinstance(expert, ExpertWeights) and expert.gate_up is not None:
            expert.gate, expert.up = expert.gate_up.chunk(2, dim=0)
        self.admitted += 1
        return None

    # ------------------------------------------------------------------ the graph
    def _parts_fn(self, model: DecodingModel, plan: list[LayerPlan]):
        cfg, act, s = model.config, model.act, self.shape

        def moe(x, h, layer, lp, weights, idx):
            self.routing.append((h, idx, weights))
            z = shared_out(act, h, lp.mlp, lp.down) if lp.mlp is not None and lp.down is not None else None
            ids, order = idx[0].sort()  # expert-id order, as every path adds them
            ws = weights[0].index_select(0, order)
            assert self.table is not None  # set up before the first run
            slots = self.table.lookup(layer, ids)
            present = slots >= 0
            ws = torch.where(present, ws, torch.zeros_like(ws))  # a miss adds 0 · (slot 0's output)
            slots = slots.clamp(min=0).long()
            acc = moe_sum(x)
            if self.layout is not None:  # every routed expert in one launch, summed in float32 in expert-id order
                y = moe_int4(h[0], self.slab["blob"], slots, ws, self.layout, scratch=self.scratch).view(1, -1)
                acc = y if acc is None else acc.add_(y)
                return add_moe(x, acc if z is None else add_shared(acc, *z))
            hb = h.to(torch.bfloat16) if self.int4_group is not None else h
            for j in range(self.k):
                acc = add_routed(acc, self._expert(h, hb, slots[j : j + 1]), ws[j : j + 1])
            return add_moe(x, acc if z is None else add_shared(acc, *z))

        def run() -> None:
            self.routing = []
            attention = static_attention(cfg, StaticKV(self.kv, self.pos), self.cos, self.sin)
            path = LayerPath(cfg, act, attention, moe)
            x = lookup(model.embed, self.token.view(1))
            for i, lp in enumerate(plan):
                x = decoder_layer(path, x, i, lp)
            self.logits = apply_linear(rms_norm(x, model.w["model.norm.weight"], s.eps), model.head)
            self.route_out = torch.cat([torch.cat([w.float(), i.float()], dim=1) for _, i, w in self.routing])

        return run

    def _expert(self, h: torch.Tensor, hb: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """The expert in ``slot`` [1] on the gate input, as its own object computes a decode row
        (``QuantizedExpert.forward_bf16`` from ``hb``, ``ExpertWeights.__call__`` from ``h``)."""
        sl = self.slab

        def pick(name: str) -> torch.Tensor:
            return sl[name].index_select(0, slot)[0]

        fused = "gate_up" in sl or "gate_up.packed" in sl
        if self.int4_group is not None:
            mm = torch._weight_int4pack_mm_for_cpu if hb.device.type == "cpu" else torch._weight_int4pack_mm
            g = self.int4_group

            def lin(role: str, x: torch.Tensor) -> torch.Tensor:
                return mm(x, pick(f"{role}.packed"), g, pick(f"{role}.scale_zero"))

            gate, up = lin("gate_up", hb).chunk(2, dim=-1) if fused else (lin("gate", hb), lin("up", hb))
            return lin("down", self.glu(gate, up))
        if fused:
            gate, up = F.linear(h, pick("gate_up")).chunk(2, dim=-1)
        else:
            gate, up = F.linear(h, pick("gate")), F.linear(h, pick("up"))
        return F.linear(self.glu(gate, up), pick("down"))

    # ------------------------------------------------------------------ a token
    def step(self, model: DecodingModel, token: torch.Tensor, cache: KVCache, plan: list[LayerPlan]) -> torch.Tensor:
        """``token`` [1, 1] continuing ``cache`` → logits [1, 1, V]."""
        if model._plan_version != self.plan_version:
            return self.give_up(model, "the model's weights changed after capture").step(model, token, cache, plan)
        if not self._begin(model, token, cache):
            return DecodeRunner.step(self, model, token, cache, plan)
        if self.table is None:
            try:
                why = self._setup()
            except RuntimeError as e:  # no room for the slab (out of memory): the per-layer graphs need none
                why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            if why is not None:
                return self._hand_over(model, why).step(model, token, cache, plan)
        run = self._parts_fn(model, plan) if not self.graphs else None
        if self.use_graph and not self.graphs:
            assert run is not None
            if not self._capture(model, [run]):
                assert self.failed is not None  # _capture says why
                return self._hand_over(model, self.failed).step(model, token, cache, plan)
        verified, syncs = 0, 0
        while True:
            if self.copy_stream is not None:  # the slots' copies land before the replay reads them
                torch.cuda.current_stream(model.device).wait_stream(self.copy_stream)
            if self.use_graph:
                self.graphs[0].replay()
            else:
                assert run is not None
                run()
            assert self.route_out is not None  # the step just ran
            host = self.route_out.cpu()  # the token's one host sync: every layer's routing in one copy
            if host.data_ptr() == self.route_out.data_ptr():  # a CPU model: its own copy, as on a GPU
                host = host.clone()
            syncs += 1
            verified, missed = self._verify(model, host, verified)
            if not missed:
                break
            if verified < 0:  # a miss that cannot take a slot: this token eagerly (its observers hear it again)
                self.eager_tokens += 1
                out = DecodeRunner.step(self, model, token, cache, plan)
                if self.refused is not None:  # a cached expert the slots cannot hold: not this token's problem alone
                    self._hand_over(model, self.refused)
                return out
            self.reruns += 1
        self.syncs_per_token.append(syncs)
        self.syncs += syncs
        self._finish(cache)
        assert self.logits is not None
        return self.logits.view(1, 1, -1)

    def _verify(self, model: DecodingModel, host: torch.Tensor, start: int) -> tuple[int, bool]:
        """Serve the step's routing through the observers and the scheduler from MoE layer ``start`` on, up to and
        including the first layer with a miss (its experts then take slots) → (how many layers are verified, or -1
        where a miss could not take a slot; whether the step had a miss, so runs again)."""
        assert self.table is not None
        k, table = self.k, self.table
        w_all, ids_all = host[:, :k], host[:, k:].long()
        for li in range(start):  # verified before: still every expert in a slot (nothing evicted them since)
            layer = self.moe_layers[li]
            if any((layer, e) not in table for e in ids_all[li].tolist()):
                return -1, True
        model.residual = None  # reported after the step: no residual to run anything early on
        for li in range(start, len(self.moe_layers)):
            layer, ids = self.moe_layers[li], ids_all[li].tolist()
            missed = any((layer, e) not in table for e in ids)
            h = self.routing[li][0]
            for obs in model.observers:
                obs(layer, h, ids_all[li : li + 1], w_all[li : li + 1])
            skipped = False
            for group in model.experts.stream_groups(layer, sorted(ids)):  # hits counted, misses read and cached
                skipped |= any(expert is None for _, expert in group)
            model.experts.end_layer(layer)
            if not missed:
                continue
            if not skipped:
                self.refused = self._sync_slots()
            if skipped or self.refused is not None or any((layer, e) not in table for e in ids):
                return -1, True
            return li + 1, True
        return len(self.moe_layers), False

    def _hand_over(self, model: DecodingModel, why: str) -> DecodeRunner:
        """The per-layer graphs instead, for good (``why`` kept): they serve any streamed expert."""
        self.failed = model.graph_off = why
        model.runner = runner = LayerGraphDecode(model, self.use_graph)
        runner.failed = why
        return runner
