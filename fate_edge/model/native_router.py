"""A softmax router (Qwen-MoE, Mixtral, OLMoE: softmax over the experts, top-k, optional renormalisation) on the CPU
in one native call (``native/router.c``) instead of five torch operators, each of which starts cold in a decode step
(docs/cpu-profile.md).

Its logits are float32 sums in the kernel's own order, so its weights may differ from torch's in the last bits; a
row's result never depends on the rows beside it, and every CPU path (a decode row alone, a batch, a prompt) routes
through it, so a token is routed the same way on each. Where the top k are not clear-cut (two equal values among
the k + 1 largest, or a NaN) it declines and the caller keeps torch's choice. Built on first use like the other
kernels (:mod:`fate_edge.native_build`); without a compiler, AVX2 and FMA, or with ``FATE_EDGE_NATIVE=0``,
:func:`available` is False and routing stays on torch.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from fate_edge.native_build import LazyKernel

if TYPE_CHECKING:
    from fate_edge.model.arch.base import ModelConfig

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_K = 64  # router.c's MAX_K and MAX_E
MAX_E = 4096


def _setup(lib: ctypes.CDLL) -> str | None:
    if not lib.fe_router_supported():
        return "this CPU lacks AVX2 or FMA"
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.fe_route_softmax.restype = i32
    lib.fe_route_softmax.argtypes = [ptr, i32, i64, i64, ptr, i32, i32, i32, ptr, ptr, i32]
    return None


_kernel = LazyKernel("fate_edge.model", "router.c", "router", "router kernel", _setup)
available = _kernel.available  # (usable here, why not)


def takes(cfg: ModelConfig, h: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :func:`route_softmax` routes rows ``h`` [N, H] through ``gate`` [E, H] for this model's router."""
    e, hidden = gate.shape
    return (
        cfg.router == "softmax"
        and bias is None
        and gate.dtype == torch.float32
        and gate.device.type == "cpu"
        and gate.is_contiguous()
        and h.device.type == "cpu"
        and h.dim() == 2
        and h.shape[1] == hidden
        and h.dtype in _DTYPES
        and hidden % 8 == 0
        and 0 < cfg.num_experts_per_tok <= min(e, MAX_K)
        and e <= MAX_E
        and not torch.compiler.is_compiling()
        and available()[0]
    )


def route_softmax(cfg: ModelConfig, h: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows ``h`` [N, H] routed by ``gate`` [E, H] → (weights [N, k] float32, expert ids [N, k] int64), largest
    first, as ``router.route`` gives them from ``F.linear(h, gate)``; None where some row's top k holds a tie or a
    NaN (torch.topk decides those). Check :func:`takes` first."""
    return top_softmax(h, gate, cfg.num_experts_per_tok, cfg.norm_topk_prob, torch.get_num_threads())


def top_softmax(
    h: torch.Tensor, gate: torch.Tensor, k: int, renormalize: bool = False, threads: int = 1
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows ``h`` [N, H] (float32 or bf16, CPU) scored by ``gate`` [E, H] (float32, contiguous; H a multiple of 8,
    k <= 64, E <= 4096) → the k largest of softmax(h · gate^T) per row (weights [N, k] float32, ids [N, k] int64),
    largest first, renormalized to sum 1 where asked; None where a row's top k holds a tie or a NaN."""
    n = h.shape[0]
    h = h.contiguous()
    weights = torch.empty(n, k, dtype=torch.float32, device="cpu")
    ids = torch.empty(n, k, dtype=torch.int64, device="cpu")
    if n == 0:
        return weights, ids
    rc = _kernel.lib.fe_route_softmax(
        h.data_ptr(),
        _DTYPES[h.dtype],
        n,
        h.shape[1],
        gate.data_ptr(),
        gate.shape[0],
        k,
        int(renormalize),
        weights.data_ptr(),
        ids.data_ptr(),
        threads,
    )
    if rc == -2:
        raise MemoryError(f"router of {n} rows: out of memory for its buffers")
    if rc != 0:
        return None
    return weights, ids
