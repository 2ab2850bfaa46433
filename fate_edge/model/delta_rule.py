"""The gated delta rule (Gated DeltaNet, Qwen3-Next's linear attention) in float32, two equal forms: chunked for a
prompt (64 positions a chunk: the in-chunk part as triangular solves and matmuls, the state carried between
chunks) and recurrent for one decode token. The math is transformers' reference (torch_chunk_gated_delta_rule,
torch_recurrent_gated_delta_rule), without padding masks.

Shapes: q, k [B, T, heads, dk] (already one per value head), v [B, T, heads, dv], g (log decay, <= 0) and beta
[B, T, heads]; the state [B, heads, dk, dv]. Returns the output [B, T, heads, dv] and the state after the rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def _prepare(q: torch.Tensor, k: torch.Tensor, *rest: torch.Tensor) -> list[torch.Tensor]:
    """[B, heads, T, ...] float32, q and k L2-normalised (eps 1e-6, as the reference's kernel option), q scaled."""
    q, k, *others = [x.transpose(1, 2).to(torch.float32).contiguous() for x in (q, k, *rest)]
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    return [q * q.shape[-1] ** -0.5, k, *others]


def recurrent(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Position by position (a decode token: one)."""
    q, k, v, beta, g = _prepare(q, k, v, beta, g)
    out = torch.zeros_like(v)
    for i in range(q.shape[2]):
        state = state * g[:, :, i].exp()[..., None, None]
        kv_mem = (state * k[:, :, i].unsqueeze(-1)).sum(dim=-2)
        delta = (v[:, :, i] - kv_mem) * beta[:, :, i].unsqueeze(-1)
        state = state + k[:, :, i].unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, i] = (state * q[:, :, i].unsqueeze(-1)).sum(dim=-2)
    return out.transpose(1, 2), state


def chunked(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt (or a chunk of one) in chunks of :data:`CHUNK` positions, from ``state``."""
    q, k, v, beta, g = _prepare(q, k, v, beta, g)
    b, h, t, _ = q.shape
    pad = -t % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    n = (t + pad) // CHUNK
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(b, h, n, CHUNK, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(b, h, n, CHUNK).cumsum(dim=-1)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    inner = (q @ k.transpose(-1, -2)) * decay
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decay = torch.linalg.solve_triangular(system, k_beta * g.exp().unsqueeze(-1), upper=False, unitriangular=True)
    out = torch.zeros_like(values)
    q = q * g.exp().unsqueeze(-1)
    k = k * (g[..., -1:] - g).exp().unsqueeze(-1)
    last = g[..., -1].exp()[..., None, None]
    state = state.to(values)
    for i in range(n):
        v_new = values[:, :, i] - k_decay[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + inner[:, :, i] @ v_new
        state = state * last[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(b, h, -1, out.shape[-1])[:, :, :t]
    return out.transpose(1, 2), state
