"""One decode row through a whole MoE decoder layer in one native call (``native/decode_layer.c``): the input norm,
the attention block (``attention_row``'s calls), the post-attention norm, the softmax router, the routed experts with
the shared expert in one fused call and their sum into the residual, on the same kernels in the same order as the
steps ``decode_step`` takes from Python, so the bits are theirs (tests/test_decode_layer.py).

Why: those steps were eight to ten calls from Python a layer, and the Python around them (the routing's dictionaries,
the experts' tables, the provider's groups, the checks) took a sixth of a decode token on the 8-layer Qwen1.5-MoE
slice at two threads, time in which the memory streams nothing (docs/measured-choices.md). Here a layer's constant
part is a program of addresses built once per layer plan and expert set (:class:`LayerProgram`), and a token pays
one call a layer and the provider's bookkeeping.

Which layers: a bf16 row whose attention ``attention_row`` takes, a softmax router ``native_router`` takes, routed
experts that fuse (``grouped_experts.fused_layer_stages``) with a SiLU-gated shared expert or none (then two or more a
token), every expert of the
layer held in memory by the provider for as long as its :meth:`~fate_edge.model.experts.ExpertProvider.resident_token`
stays the same (a resident model, or a cache that holds it whole, with nothing in flight). Anything else, a full KV
cache, or a router tie (decided by torch.topk) takes the general path for that layer or its MoE half.
"""

from __future__ import annotations

import array
import ctypes
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from fate_edge.model import attention_row, decode_attention, native_router, row_ops
from fate_edge.model.grouped_experts import fused_layer_stages, native_shared, stages_and_layout
from fate_edge.model.routed_experts import moe_block
from fate_edge.native_build import LazyKernel
from fate_edge.quant import native as int4
from fate_edge.quant.native import NativeInt4

if TYPE_CHECKING:
    from fate_edge.model.decoding_model import DecodingModel
    from fate_edge.model.kv_cache import KVCache
    from fate_edge.model.layer import LayerPlan
    from fate_edge.model.row_ops import RopeRows

FIELDS = 54  # native/decode_layer.c's L_FIELDS


def _setup(lib: ctypes.CDLL) -> str | None:
    parts = (int4.native_status(), row_ops.available(), decode_attention.available(), native_router.available())
    why = next((reason for ok, reason in parts if not ok), None)
    if why is not None:
        return why
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.fe_decode_layer_bind.restype = None
    lib.fe_decode_layer_bind.argtypes = [ptr]
    lib.fe_decode_layer_scratch.restype = i64
    lib.fe_decode_layer_scratch.argtypes = [ptr]
    lib.fe_decode_layer.restype = i32
    lib.fe_decode_layer.argtypes = [ptr] * 6 + [ptr, ptr] + [i64] * 5 + [ptr] * 4 + [i32, i32, i32]
    lib.fe_decode_layer_fields.restype = i32
    if lib.fe_decode_layer_fields() != FIELDS:
        return f"decode_layer.c's program has {lib.fe_decode_layer_fields()} fields where this module builds {FIELDS}"
    bind(lib, entry_points())
    return None


def entry_points() -> list[int]:
    """The addresses ``fe_decode_layer_bind`` takes, in its order: the kernels a layer's call makes."""
    libs = (row_ops._kernel.lib, decode_attention._kernel.lib, native_router._kernel.lib)
    names = (
        (0, "fe_rms_norm_bf16"),
        (0, "fe_rope_bf16"),
        (0, "fe_kv_append"),
        (0, "fe_add_bf16"),
        (0, "fe_moe_combine"),
        (1, "fe_decode_attention"),
        (2, "fe_route_softmax"),
        (0, "fe_head_norm_bf16"),
    )
    int4_fns = [int4.function_address("fe_int4_gemm"), int4.function_address("fe_int4_glu_grouped")]
    return int4_fns + [ctypes.cast(getattr(libs[i], name), ctypes.c_void_p).value or 0 for i, name in names]


def bind(lib: ctypes.CDLL, fns: list[int]) -> None:
    """The decode layer library's kernels set to ``fns`` (:func:`entry_points`' order); it copies the addresses."""
    table = array.array("q", fns)
    lib.fe_decode_layer_bind(table.buffer_info()[0])


_kernel = LazyKernel("fate_edge.model", "decode_layer.c", "decode_layer", "decode layer kernel", _setup)
available = _kernel.available  # (usable here, why not)


def _f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def _matrix(m: NativeInt4) -> list[int]:
    """A matrix's eight program fields."""
    return m.own_args()


@dataclass
class LayerProgram:
    """A layer's constant part as ``fe_decode_layer`` reads it, and what keeps its addresses valid."""

    fields: array.array  # int64 [FIELDS]
    experts: array.array  # int64 [E][(first + 1) * 8]: the table ``fields`` points at
    scratch: int  # bytes a call needs
    hidden: int
    top_k: int
    held: tuple  # the layer's own tensors and matrices behind the addresses (the experts' stay the provider's)
    layout: tuple = ()  # what every expert in the table shares (grouped_experts' layout): a later one must match

    def fill(self, experts: dict[int, Any]) -> bool:
        """The table's rows of ``experts`` (id → expert) written (a cache under a budget: the routed ones, before
        phase 2); False where one does not take the program's layout (nothing written)."""
        rows = []
        for e, expert in experts.items():
            got = stages_and_layout(expert)
            if got is None or got[1] != self.layout:
                return False
            (up, down), width = got[0], 8 * (len(got[0][0]) + 1)
            rows.append((e * width, [field for m in (*up, down) for field in _matrix(m)]))
        for at, fields in rows:
            self.experts[at : at + len(fields)] = array.array("q", fields)
        return True


def build(model: DecodingModel, lp: LayerPlan, experts: dict[int, Any]) -> LayerProgram | None:
    """``lp``'s program with ``experts`` (id → expert: every expert of the layer where the provider holds them all,
    or those a cache holds for one token, whose table rows :meth:`LayerProgram.fill` rewrites), or None where the
    layer is not one :func:`DecodeLayers.run` takes (module docstring)."""
    cfg = model.config
    att = attention_row.plan_of(cfg, lp)
    if att is None or lp.router is None or lp.correction_bias is not None or (lp.mlp is None) != (lp.down is None):
        return None
    if not experts or any(not 0 <= e < lp.router.shape[0] for e in experts):
        return None
    hidden = att.hidden
    norms = (lp.input_norm, lp.post_norm)
    if not all(attention_row.bf16_row(w, hidden) for w in norms):
        return None
    if hidden > row_ops.RMS_NORM_MAX:
        return None
    h = torch.empty(1, hidden, dtype=torch.bfloat16, device="cpu")  # on the host, whatever the default device
    if not native_router.takes(cfg, h, lp.router, lp.router_bias):
        return None
    k = cfg.num_experts_per_tok
    shared = None
    if lp.mlp is not None and lp.down is not None:
        shared = native_shared(model.act, lp.mlp, lp.down)
        if shared is None or model.act is not F.silu:
            return None
    elif k < 2:  # one expert alone is not grouped on the general path (routed_experts: its own call, other bits)
        return None
    stages = fused_layer_stages(list(experts.values()), shared, hidden)
    if stages is None:
        return None
    ups, down = stages[0]
    inter = sum(m.shape[0] for m in ups) // 2
    table = array.array("q", bytes(8 * 8 * (len(ups) + 1) * lp.router.shape[0]))  # rows of absent experts: 0
    no_matrix = [0] * 8
    fields = array.array(
        "q",
        [
            hidden,
            _f32_bits(cfg.rms_norm_eps),
            lp.input_norm.data_ptr(),
            lp.post_norm.data_ptr(),
            *_matrix(att.qkv),
            0 if att.bias is None else att.bias.data_ptr(),
            *_matrix(att.o),
            att.n_q,
            att.n_k,
            att.head_dim,
            _f32_bits(att.head_dim**-0.5),
            lp.router.data_ptr(),
            lp.router.shape[0],
            k,
            int(cfg.norm_topk_prob),
            *(no_matrix if shared is None else _matrix(shared.gate_up)),
            *(no_matrix if shared is None else _matrix(shared.down)),
            0 if shared is None else shared.sizes[0],
            int(shared is not None and len(shared.sizes) == 3),
            inter,
            len(ups),
            table.buffer_info()[0],
            int4.silu_table().data_ptr(),
            row_ops.sigmoid_table().data_ptr(),
            0 if att.q_norm is None else att.q_norm.data_ptr(),
            0 if att.k_norm is None else att.k_norm.data_ptr(),
        ],
    )
    assert len(fields) == FIELDS
    scratch = int(_kernel.lib.fe_decode_layer_scratch(fields.buffer_info()[0]))
    # Not the experts: the program is used only while the provider's token holds, so they are alive whenever it is,
    # and a reference here would keep an evicted expert's read buffer from going back to the pool
    held = (att, shared, lp.router, norms)
    layout = stages_and_layout(next(iter(experts.values())))
    assert layout is not None  # fused_layer_stages took it
    prog = LayerProgram(fields, table, scratch, hidden, k, held, layout[1])
    filled = prog.fill(experts)
    assert filled  # one layout: fused_layer_stages checked
    return prog


def _key(lp: LayerPlan, token: object) -> tuple:
    qkv, o, mlp, down = lp.qkv, lp.o_proj, lp.mlp, lp.down
    return (
        qkv,
        o,
        None if qkv is None else qkv.weight,
        None if qkv is None else qkv.bias,
        o.weight,
        lp.input_norm,
        lp.post_norm,
        lp.router,
        mlp,
        down,
        None if mlp is None else mlp.weight,
        None if down is None else down.weight,
        token,
    )


CACHED = "cached"  # the token of a cache under a budget: its programs' expert rows are filled by each call


def program_of(model: DecodingModel, lp: LayerPlan, layer: int, token: object) -> LayerProgram | None:
    """``lp``'s :class:`LayerProgram` while the provider's ``token`` holds (None: not taken), kept on the plan and made
    again when any part it was made from was replaced or the token changed. Under a budget (:data:`CACHED`) it is made
    from the experts the cache holds when it is first asked (tried again while it holds none)."""
    key = _key(lp, token)
    held = lp.__dict__.get("_decode_layer")
    if held is not None and held[0][-1] == token and all(a is b for a, b in zip(held[0][:-1], key[:-1])):
        return held[1]
    if token == CACHED:
        some = model.experts.cached_layer(layer)
        if not some:
            return None
        made = build(model, lp, some)
    else:
        experts = model.experts.resident_layer(layer, model.config.num_experts)
        made = None if experts is None else build(model, lp, dict(enumerate(experts)))
    lp.__dict__["_decode_layer"] = (key, made)
    return made


class DecodeLayers:
    """One decode token's layers through :func:`fe_decode_layer` where they take it (:meth:`run`). Where the provider
    holds every expert, one call a layer; where a cache under a budget holds some, two: the attention block and the
    router, then (the observers told, the scheduler's reads and predictions issued) the experts where the cache holds
    every routed one, else the general path's MoE block on that routing."""

    def __init__(self, model: DecodingModel, cache: KVCache, rot: RopeRows, token: object):
        self.model, self.cache, self.rot, self.token = model, cache, rot, token
        self.threads, self.isa = torch.get_num_threads(), int4.isa_level()

    @staticmethod
    def of(model: DecodingModel, cache: KVCache, rot: object) -> DecodeLayers | None:
        """The token's :class:`DecodeLayers`, or None where no layer can take it (checked once a token)."""
        if not isinstance(rot, row_ops.RopeRows) or model.dtype != torch.bfloat16 or not available()[0]:
            return None
        token = model.experts.resident_token()
        if token is None and model.experts.serves_cached_layers:
            token = CACHED
        return None if token is None else DecodeLayers(model, cache, rot, token)

    def run(self, x: torch.Tensor, layer: int, lp: LayerPlan) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Decoder layer ``layer`` on the row ``x`` [1, H] (bf16) → (the new residual, None), or (the attention's
        residual, the MoE block's input) where the router declined and the caller finishes the layer's MoE half; None
        where the layer, the row or the cache is not one this takes (nothing done)."""
        if lp.router is None:
            return None
        model = self.model
        prog = program_of(model, lp, layer, self.token)
        if prog is None:
            return None
        att = prog.held[0]
        slot = attention_row.cache_slot(model.config, self.cache, layer, att)
        if slot is None or x.shape != (1, prog.hidden) or x.dtype != torch.bfloat16 or not x.is_contiguous():
            return None
        lay, kb, vb, at = slot
        k = prog.top_k
        x_out = torch.empty_like(x)
        h = torch.empty_like(x)
        # on x's device (the host), not the default one: under a meta default a buffer would have no memory
        ids = torch.empty(1, k, dtype=torch.int64, device=x.device)
        w = torch.empty(1, k, dtype=torch.float32, device=x.device)
        ns = array.array("q", [0])
        scratch = torch.empty(prog.scratch, dtype=torch.uint8, device=x.device)
        ks, vs = kb.stride(), vb.stride()
        phase = 1 if self.token == CACHED else 0
        call = (prog, x, x_out, h, kb, vb, ks, vs, at, scratch, ids, w, ns)
        self._check(self._call(*call, phase), layer)
        lay.length += 1
        if ns[0] < 0:  # a tie in the router's top k (the call's 1)
            return x_out, h
        model.residual = x_out
        for obs in model.observers:
            obs(layer, h, ids, w)
        order = sorted(ids[0].tolist())
        if phase == 0:
            model.experts.served_resident(layer, order, ns[0] * 1e-9)
            return x_out, None
        taken = model.experts.take_cached(layer, order, prog.fill)
        if taken is None:  # a routed expert to read: the general path's MoE block, the observers told
            return moe_block(model, x_out, h, layer, lp, w, ids, True, observed=True), None
        self._check(self._call(*call, 2), layer)
        model.experts.served_cached(layer, len(order), ns[0] * 1e-9)
        return x_out, None

    def _call(
        self,
        prog: LayerProgram,
        x: torch.Tensor,
        x_out: torch.Tensor,
        h: torch.Tensor,
        kb: torch.Tensor,
        vb: torch.Tensor,
        ks: tuple[int, ...],
        vs: tuple[int, ...],
        at: int,
        scratch: torch.Tensor,
        ids: torch.Tensor,
        w: torch.Tensor,
        ns: array.array,
        phase: int,
    ) -> int:
        """``fe_decode_layer`` (``phase`` 0: the whole layer, 1: to the router, 2: the rest) → its return code; a
        tie (1) also as ``ns[0]`` = -1."""
        rc = _kernel.lib.fe_decode_layer(
            prog.fields.buffer_info()[0],
            x.data_ptr(),
            x_out.data_ptr(),
            h.data_ptr(),
            self.rot.cos.data_ptr(),
            self.rot.sin.data_ptr(),
            kb.data_ptr(),
            vb.data_ptr(),
            ks[1],
            ks[2],
            vs[1],
            vs[2],
            at,
            scratch.data_ptr(),
            ids.data_ptr(),
            w.data_ptr(),
            ns.buffer_info()[0],
            self.threads,
            self.isa,
            phase,
        )
        if rc == 1:
            ns[0] = -1
        return int(rc)

    @staticmethod
    def _check(rc: int, layer: int) -> None:
        if rc == -2:
            raise MemoryError(f"decode layer {layer}: out of memory for its kernels' buffers")
        if rc < 0:
            raise RuntimeError(f"decode layer {layer}: a kernel refused the shapes its program was checked for")
