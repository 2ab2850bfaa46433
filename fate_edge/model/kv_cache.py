"""Per-layer key/value cache, grown geometrically so decode appends are amortised O(1)."""

from __future__ import annotations

import torch


class LayerCache:
    """Holds any number of aligned tensors [B, heads, S, d] (k and v, or MLA's latent and rope key)."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.length = 0

    def reserve(self, n: int) -> list[torch.Tensor]:
        """Room for ``n`` positions (buffers made by a first :meth:`append`); the buffers, at full capacity.

        Grown buffers start zeroed: a compiled decode step attends over the whole buffer with the tail masked,
        and a masked-out NaN would still poison the weighted sum (0 * NaN)."""
        if n > self.buffers[0].shape[2]:
            cap = max(2 * self.buffers[0].shape[2], n)
            grown = [b.new_zeros(*b.shape[:2], cap, b.shape[3]) for b in self.buffers]
            for g, b in zip(grown, self.buffers):
                g[:, :, : self.length] = b[:, :, : self.length]
            self.buffers = grown
        return self.buffers

    def append(self, *new: torch.Tensor, capacity_hint: int = 0) -> tuple[torch.Tensor, ...]:
        t = new[0].shape[2]
        if not self.buffers:  # the request's whole length when known: growing copies the cache (twice it, briefly)
            cap = max(64, t, capacity_hint)
            self.buffers = [x.new_zeros(*x.shape[:2], cap, x.shape[3]) for x in new]
        self.reserve(self.length + t)
        for b, x in zip(self.buffers, new):  # narrow: cheaper to dispatch than slice indexing, per decode token
            b.narrow(2, self.length, t).copy_(x)
        self.length += t
        return tuple(b.narrow(2, 0, self.length) for b in self.buffers)


class KVCache:
    def __init__(self, num_layers: int, capacity_hint: int = 0):
        self.layers = [LayerCache() for _ in range(num_layers)]
        self.capacity_hint = capacity_hint  # positions the request will reach (prompt + answer), 0: unknown

    @property
    def length(self) -> int:
        return self.layers[0].length

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for lay in self.layers for b in lay.buffers)
