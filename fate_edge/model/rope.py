"""Rotary position embeddings: default, linear, dynamic NTK and YaRN frequencies; half-split or interleaved pairs.

The frequency formulas follow the papers (and transformers' ``modeling_rope_utils``) so logits match the
reference implementation bit for bit in fp32.
"""

from __future__ import annotations

import math

import torch

from fate_edge.model.arch.base import RopeConfig


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_scale(rope: RopeConfig) -> float:
    """DeepSeek multiplies the attention softmax scale by mscale² when YaRN is on."""
    if rope.rope_type != "default" and rope.mscale_all_dim:
        m = _yarn_mscale(rope.factor, rope.mscale_all_dim)
        return m * m
    return 1.0


class RotaryEmbedding:
    """Holds inverse frequencies for ``dim`` rotary channels and applies them at given positions."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_position_embeddings: int):
        self.rope = rope
        self.dim = int(head_dim * rope.partial_rotary_factor)
        self.max_position_embeddings = max_position_embeddings
        self.attention_scaling = 1.0
        # Tables per (device, dtype): built once where they are used, so no step copies them across devices.
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self.inv_freq = self._base_inv_freq(rope.theta)
        self._original_inv_freq = self.inv_freq
        # Dynamic NTK counts from max_position_embeddings (as transformers does; a config's
        # original_max_position_embeddings is ignored for this type).
        self._cached_len = max_position_embeddings
        if rope.rope_type == "linear":
            self.inv_freq = self.inv_freq / rope.factor
        elif rope.rope_type == "yarn":
            self.inv_freq, self.attention_scaling = self._yarn()

    def _base_inv_freq(self, base: float) -> torch.Tensor:
        return 1.0 / (base ** (torch.arange(0, self.dim, 2, dtype=torch.int64).float() / self.dim))

    def _yarn(self) -> tuple[torch.Tensor, float]:
        r, dim, base = self.rope, self.dim, self.rope.theta
        factor = r.factor
        if r.attention_factor is not None:
            attn = float(r.attention_factor)
        elif r.mscale and r.mscale_all_dim:
            attn = _yarn_mscale(factor, r.mscale) / _yarn_mscale(factor, r.mscale_all_dim)
        else:
            attn = _yarn_mscale(factor)
        orig = r.original_max_position_embeddings
        assert orig is not None, "YaRN needs original_max_position_embeddings (RopeConfig.from_hf sets it)"

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
        if r.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # avoid a zero-width ramp
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolation_weight = 1 - ramp
        pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
        inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
        return inv, attn

    def _maybe_grow_dynamic(self, seq_len: int) -> None:
        # Dynamic NTK, stateful exactly as transformers' ``dynamic_rope_update``: once the sequence outgrows the
        # longest one seen (at first max_position_embeddings), raise the base for that length (keys already
        # cached keep the frequencies they were rotated with); a sequence back within the trained context
        # (a new prompt on a fresh cache) returns to the original frequencies.
        if self.rope.rope_type != "dynamic":
            return
        orig = self.max_position_embeddings
        if seq_len > self._cached_len:
            f = self.rope.factor
            base = self.rope.theta * ((f * seq_len / orig) - (f - 1)) ** (self.dim / (self.dim - 2))
            self.inv_freq = self._base_inv_freq(base)
            self._cached_len = seq_len
        if seq_len < orig and self._cached_len > orig:
            self.inv_freq = self._original_inv_freq
            self._cached_len = orig

    def cos_sin_range(
        self, start: int, t: int, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [t, dim] on ``device`` for positions ``start .. start + t - 1``: slices of a table per (device,
        dtype), grown in powers
        of two as positions come (a position's row does not depend on the table's length). The whole context at
        once cost a short first prompt the table of every position (docs/measured-choices.md).

        Dynamic NTK changes its frequencies with the sequence length, so it computes them each call.
        """
        device = torch.device(device)
        if self.rope.rope_type == "dynamic" or start + t > self.max_position_embeddings:
            return self.cos_sin(torch.arange(start, start + t, device=device), dtype)
        table = self._tables.get((device, dtype))
        if table is None or table[0].shape[0] < start + t:
            size = min(self.max_position_embeddings, max(1024, 1 << (start + t - 1).bit_length()))
            table = self._tables[(device, dtype)] = self.cos_sin(torch.arange(size, device=device), dtype)
        cos, sin = table
        return cos[start : start + t], sin[start : start + t]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and *signed* sin, each [T, dim], for integer ``positions`` [T].

        The sin's first half is negated (``[-sin, sin]``) so :func:`apply_rope` rotates with one roll and no
        negation; negating is exact, so the result is the reference's ``x * cos + rotate_half(x) * sin``.
        """
        self._maybe_grow_dynamic(int(positions.max()) + 1)
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]  # [T, dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        sin = emb.sin() * self.attention_scaling
        sin[:, : freqs.shape[1]].neg_()
        return (emb.cos() * self.attention_scaling).to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate ``x`` [B, heads, T, dim] (the first ``cos.shape[-1]`` channels; the rest pass through).

    ``cos`` and signed ``sin`` come from :meth:`RotaryEmbedding.cos_sin`.
    """
    rot_dim = cos.shape[-1]
    partial = rot_dim != x.shape[-1]
    x_rot = x[..., :rot_dim] if partial else x
    dtype = x.dtype
    if dtype != cos.dtype:
        x_rot = x_rot.to(cos.dtype)  # the rotation runs in cos/sin's dtype (float32 for DeepSeek-V2), then casts back
    half = rot_dim // 2
    if interleaved:
        # Pairs (x0,x1),(x2,x3),... share one angle. The output is laid out evens-then-odds; q and k are
        # permuted alike, so attention scores equal those of the pairwise (complex) formulation.
        c, s = cos[..., :half], sin[..., half:]
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    else:
        out = x_rot * cos + x_rot.roll(half, -1) * sin  # roll: [x2, x1]; signed sin: [-sin, sin]
    if out.dtype != dtype:
        out = out.to(dtype)
    return torch.cat([out, x[..., rot_dim:]], dim=-1) if partial else out
