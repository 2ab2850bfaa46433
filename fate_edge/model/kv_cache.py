"""The state an attention layer keeps between forward passes, behind one interface: :class:`AttentionState`.

Every forward path writes a layer's new keys and values with ``state.update(layer, k, v)`` and gets back what the
layer's queries read (:data:`Keys`): a sequence's held positions themselves, ``(k_all, v_all)``, or a
:class:`Held` saying how the queries see a buffer of another kind. The attention functions
(:mod:`fate_edge.model.attention`, :mod:`fate_edge.model.mla`) are written once against that; the kinds of state
differ only in where the positions live:

* :class:`KVCache`: one sequence's cache that grows (geometrically, so a decode append is amortised O(1)); its
  queries see a prefix of positions (the plain tuple);
* ``kv_slab.SlabCache``: the same, as a range of a batch's shared slab; ``kv_slab.SlabRows``: one decode row per
  sequence of a slab in one update, each row seeing its own range (``Held.rows``);
* :class:`StaticKV`: whole-capacity buffers written at a position tensor, the unwritten tail masked
  (``Held.mask``): what a compiled or captured step needs (static shapes and addresses).

New kinds belong here too, as subclasses of :class:`AttentionState` whose ``update`` returns what their attention
reads: a sliding-window ring or attention sinks (keep only the positions a query can see, a ``Held`` field saying
where they start), or a recurrent state (linear attention, a convolution's last inputs: ``update(layer, *new)``
folds the new rows in and hands back the state, in ``Held.held`` with a field naming its kind). A new field gets its
branch in the family's ``attend``.

Keeping a state past its request (``runtime.prompt_cache``): a kind saves a layer with ``save_layer(layer, n)`` as a
:class:`SavedLayer` and a new sequence's empty state takes it back with ``restore_layer(layer, saved, n)``. Positional
kinds (keys and values, MLA's latent) save their first ``n`` positions, and any prefix of them can be restored: a new
prompt that shares only ``m`` < ``n`` tokens with the saved one reuses ``m``. A recurrent state (a convolution's last
inputs, a linear-attention state) cannot be cut back: it saves a *snapshot* (``SavedLayer.positional`` False) taken at
its length, usable only by a prompt that shares exactly that many tokens (``SavedLayer.usable``); the prompt cache then
refuses any shorter reuse for the whole sequence. A kind that does neither raises ``NotImplementedError`` (not kept).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Held:
    """What a layer's queries read after an update of a state that is not one sequence's prefix (that one hands back
    its tensors as a plain tuple). ``held``: the buffer's tensors (k and v [B, kv heads, S, d], or MLA's latent [B, 1,
    S, r + rope]). Which of them a query sees, by kind of state:

    * ``mask`` [1, S]: one query over a whole-capacity buffer, True where written (:class:`StaticKV`);
    * ``rows``: one decode query per sequence of a slab, each over its own range (``kv_slab.SlabRows``);
    * ``parts``: a batch of sequences, each part (which query rows: a slice, or an index tensor for a slab's decode
      rows, first) with what its own state handed back (``batch_step.BatchState``);
    * ``kind``: a recurrent layer's state (:class:`RecurrentLayer`): "conv", the convolution's window (its last
      inputs, then the new rows), or "delta", that window and the DeltaNet matrix to read and overwrite."""

    held: tuple[torch.Tensor, ...] = ()
    mask: torch.Tensor | None = None
    rows: RowRanges | None = None
    parts: list[tuple[slice | torch.Tensor, Keys]] | None = None
    kind: str | None = None


# What an update hands back: one sequence's held positions 0 .. S-1 themselves (k and v, or MLA's latent), its T new
# queries the last T of them; or a Held of another kind.
Keys = tuple[torch.Tensor, ...] | Held


class RowRanges(Protocol):
    """One decode row per sequence over one buffer, each row seeing its own range (``kv_slab.SlabRows``)."""

    longest: int  # the longest range

    @property
    def gather(self) -> torch.Tensor:
        """[rows * longest] buffer positions of each range's first ``longest`` positions."""
        ...

    def ranges(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """([rows] first position, [rows] count) each row sees (its last ``window``), int64 on the host."""
        ...

    def mask(self, window: int | None) -> torch.Tensor:
        """[rows, 1, 1, longest]: which gathered positions each row sees."""
        ...

    def views(self, layer: int) -> list[tuple[torch.Tensor, ...]]:
        """Each row's own positions of ``layer`` as a sequence's prefix."""
        ...


@dataclass
class SavedLayer:
    """One layer's state kept past its request (``runtime.prompt_cache``): positional tensors [B, heads, length, d]
    whose every prefix is reusable, or a recurrent state's snapshot, reusable only at exactly ``length``."""

    tensors: tuple[torch.Tensor, ...]
    length: int  # positions saved (a snapshot: the length it was taken at)
    positional: bool = True

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def usable(self, n: int) -> bool:
        """Whether a new sequence may take this layer's first ``n`` positions."""
        return n <= self.length if self.positional else n == self.length


class AttentionState(ABC):
    """Per-layer attention state of one sequence (or of a batch's decode rows): the interface every forward path
    writes through and every attention function reads through."""

    @abstractmethod
    def update(self, layer: int, *new: torch.Tensor) -> Keys:
        """Add ``new`` (k and v [B, kv heads, T, d], or MLA's latent) at the next positions of ``layer`` → what the
        layer's queries read. A forward pass updates each layer once."""

    def save_layer(self, layer: int, n: int) -> SavedLayer:
        """``layer``'s state of the first ``n`` positions, copied so it outlives this state (a recurrent kind: a
        snapshot, only where ``n`` is its length). Kinds that cannot be kept raise NotImplementedError."""
        raise NotImplementedError(f"{type(self).__name__} cannot be kept past its request")

    def saved_nbytes(self, layer: int, n: int) -> int:
        """Bytes :meth:`save_layer` would copy for ``n`` positions (known before copying, so room is made first)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be kept past its request")

    def restore_layer(self, layer: int, saved: SavedLayer, n: int) -> None:
        """Start ``layer`` (empty) from ``saved``'s first ``n`` positions (``saved.usable(n)``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot start from a kept state")


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
        n = self.length + t
        if n > self.buffers[0].shape[2]:
            self.reserve(n)
        for b, x in zip(self.buffers, new):  # narrow: cheaper to dispatch than slice indexing, per decode token
            b.narrow(2, self.length, t).copy_(x)
        self.length = n
        return tuple([b.narrow(2, 0, n) for b in self.buffers])  # a list, not a generator: one frame, not three


@dataclass(frozen=True)
class RecurrentSpec:
    """A recurrent layer's state shape: ``kind`` "conv" (a causal convolution's last ``kernel - 1`` inputs of
    ``channels``) or "delta" (those and a float32 matrix ``matrix`` [heads, key dim, value dim])."""

    kind: str
    channels: int
    kernel: int
    matrix: tuple[int, int, int] | None = None


class RecurrentLayer:
    """A recurrent layer's state of one sequence, in place of a :class:`LayerCache`: a fixed size, whatever the
    length. ``append(x)`` (the new convolution inputs [B, channels, T]) folds them into the window and hands back
    ``Held(kind=...)``: the window [B, channels, kernel - 1 + T] and, for "delta", the matrix [B, heads, dk, dv],
    which the mixer overwrites with the state after the new rows. Zeros before the first append, as the reference's
    zero padding. A state is only right at its own length: :meth:`snapshot` keeps it with that length."""

    def __init__(self, spec: RecurrentSpec):
        self.spec = spec
        self.conv: torch.Tensor | None = None
        self.matrix: torch.Tensor | None = None
        self.length = 0

    @property
    def buffers(self) -> list[torch.Tensor]:
        return [t for t in (self.conv, self.matrix) if t is not None]

    @buffers.setter
    def buffers(self, value: list[torch.Tensor]) -> None:  # a released slab range: the state goes
        if value:
            raise ValueError("a recurrent layer's state is not a slab range")
        self.conv = self.matrix = None

    def append(self, *new: torch.Tensor, capacity_hint: int = 0) -> Held:
        x = new[0]
        s = self.spec
        if self.conv is None:
            self.conv = x.new_zeros(x.shape[0], s.channels, s.kernel - 1)
            if s.matrix is not None:
                self.matrix = x.new_zeros(x.shape[0], *s.matrix, dtype=torch.float32)
        window = torch.cat([self.conv, x], dim=2)
        self.conv = window[:, :, window.shape[2] - (s.kernel - 1) :].clone()
        self.length += x.shape[2]
        held = (window,) if self.matrix is None else (window, self.matrix)
        return Held(held, kind=s.kind)

    def snapshot(self) -> tuple[int, list[torch.Tensor]]:
        return self.length, [t.clone() for t in self.buffers]

    def restore(self, saved: tuple[int, list[torch.Tensor]]) -> None:
        self.length, tensors = saved
        self.conv, self.matrix = (tensors + [None, None])[:2] if tensors else (None, None)


CacheSnapshot = list[int | tuple[int, list[torch.Tensor]]]


class KVCache(AttentionState):
    """One sequence's cache, grown per layer as positions arrive (``recurrent``: the layers that keep a recurrent
    state instead, by index)."""

    def __init__(self, num_layers: int, capacity_hint: int = 0, recurrent: dict[int, RecurrentSpec] | None = None):
        recurrent = recurrent or {}
        self.layers: list[LayerCache | RecurrentLayer] = [
            RecurrentLayer(recurrent[i]) if i in recurrent else LayerCache() for i in range(num_layers)
        ]
        self.capacity_hint = capacity_hint  # positions the request will reach (prompt + answer), 0: unknown

    def snapshot(self) -> CacheSnapshot:
        """What :meth:`restore` needs to bring the cache back to now: each attention layer's length (its positions
        past it are simply overwritten later), each recurrent layer's state, copied."""
        return [lay.snapshot() if isinstance(lay, RecurrentLayer) else lay.length for lay in self.layers]

    def restore(self, saved: CacheSnapshot) -> None:
        """Back to a :meth:`snapshot` of this cache (an undone step)."""
        for lay, s in zip(self.layers, saved):
            if isinstance(lay, RecurrentLayer):
                assert isinstance(s, tuple)
                lay.restore(s)
            else:
                assert isinstance(s, int)
                lay.length = s

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` positions (a prompt cache reusing a prefix). A recurrent state holds only its own
        length: cutting it elsewhere is refused."""
        for lay in self.layers:
            if isinstance(lay, RecurrentLayer) and lay.length != n:
                raise ValueError(f"a recurrent state of {lay.length} positions cannot be cut to {n}")
        for lay in self.layers:
            lay.length = min(lay.length, n)

    @property
    def length(self) -> int:
        return self.layers[0].length

    def update(self, layer: int, *new: torch.Tensor) -> Keys:
        return self.layers[layer].append(*new, capacity_hint=self.capacity_hint)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for lay in self.layers for b in lay.buffers)

    def save_layer(self, layer: int, n: int) -> SavedLayer:
        held = self.layers[layer]
        if isinstance(held, RecurrentLayer):  # a snapshot, right only at its own length
            if n != held.length or not held.buffers:
                raise ValueError(f"layer {layer}'s recurrent state holds {held.length} positions; cannot save {n}")
            return SavedLayer(tuple(b.clone() for b in held.buffers), n, positional=False)
        if not 0 < n <= held.length:
            raise ValueError(f"layer {layer} holds {held.length} positions; cannot save {n}")
        return SavedLayer(tuple(b.narrow(2, 0, n).clone() for b in held.buffers), n)

    def saved_nbytes(self, layer: int, n: int) -> int:
        held = self.layers[layer]
        if isinstance(held, RecurrentLayer):  # a fixed size, whatever the length
            return sum(b.numel() * b.element_size() for b in held.buffers)
        return n * sum(b[:, :, :1].numel() * b.element_size() for b in held.buffers)

    def restore_layer(self, layer: int, saved: SavedLayer, n: int) -> None:
        held = self.layers[layer]
        if held.length or not saved.usable(n):
            raise ValueError(f"layer {layer} cannot start from {n} of {saved.length} saved positions")
        if isinstance(held, RecurrentLayer):  # copies: the mixer overwrites its matrix in place
            if saved.positional:
                raise ValueError(f"layer {layer} is recurrent; a positional state cannot start it")
            held.restore((n, [t.clone() for t in saved.tensors]))
            return
        held.append(*(t.narrow(2, 0, n) for t in saved.tensors), capacity_hint=self.capacity_hint)


class StaticKV(AttentionState):
    """Whole-capacity buffers per layer (``kv``: k and v [1, kv heads, capacity, d]) for one decode token at ``pos``
    [1] (a tensor: a compiled or captured step reads it on the device): its k and v written there, its query seeing
    the written positions (the unwritten tail masked, so the buffers start zeroed: 0 * NaN would poison the sum)."""

    def __init__(self, kv: list[tuple[torch.Tensor, torch.Tensor]], pos: torch.Tensor):
        self.kv, self.pos = kv, pos
        self.mask = (torch.arange(kv[0][0].shape[2], device=pos.device) <= pos).view(1, -1)

    def update(self, layer: int, *new: torch.Tensor) -> Held:
        bufs = self.kv[layer]
        for buf, x in zip(bufs, new):
            buf.index_copy_(2, self.pos, x)
        return Held(bufs, mask=self.mask)
