"""The state an attention layer keeps between forward passes, behind one interface: :class:`AttentionState`.

Every forward path writes a layer's new keys and values with ``state.update(layer, k, v)`` and gets back what the
layer's queries read (:data:`Keys`): a sequence's held positions themselves, ``(k_all, v_all)``, or a
:class:`Held` saying how the queries see a buffer of another kind. The attention functions
(:mod:`fate_edge.model.attention`, :mod:`fate_edge.model.mla`) are written once against that; the kinds of state
differ only in where the positions live:

* :class:`KVCache`: one sequence's cache that grows (geometrically, so a decode append is amortised O(1)); its
  queries see a prefix of positions (the plain tuple); a sliding-window layer's (:class:`LayerCache` ``window``)
  keeps only the end its later queries can read, and hands back consecutive positions that no longer start at 0
  (the window's mask is relative, so attention reads them as it reads a prefix);
* ``kv_slab.SlabCache``: the same, as a range of a batch's shared slab; ``kv_slab.SlabRows``: one decode row per
  sequence of a slab in one update, each row seeing its own range (``Held.rows``);
* :class:`StaticKV`: whole-capacity buffers written at a position tensor, the unwritten tail masked
  (``Held.mask``): what a compiled or captured step needs (static shapes and addresses).

New kinds belong here too, as subclasses of :class:`AttentionState` whose ``update`` returns what their attention
reads, like the recurrent state (linear attention, a convolution's last inputs: ``update(layer, *new)`` folds the
new rows in and hands back the state, in ``Held.held`` with a field naming its kind: :class:`RecurrentLayer`). A
new field gets its branch in the family's ``attend``.

Keeping a state past its request (``runtime.prompt_cache``): a kind saves a layer with ``save_layer(layer, n)`` as a
:class:`SavedLayer` and a new sequence's empty state takes it back with ``restore_layer(layer, saved, n)``. Positional
kinds (keys and values, MLA's latent) save their first ``n`` positions, and any prefix of them can be restored: a new
prompt that shares only ``m`` < ``n`` tokens with the saved one reuses ``m`` (a sliding-window layer saves only its
end, ``SavedLayer.first``: reusable where that still holds the window before ``m``). A recurrent state (a
convolution's last inputs, a linear-attention state) cannot be cut back: it saves a *snapshot*
(``SavedLayer.positional`` False) taken at its length, usable only by a prompt that shares exactly that many tokens
(``SavedLayer.usable``); the prompt cache then refuses any shorter reuse for the whole sequence. A kind that does
neither raises ``NotImplementedError`` (not kept).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from fate_edge.model.arch.base import ModelConfig


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
    """One layer's state kept past its request (``runtime.prompt_cache``): positional tensors [B, heads, length -
    first, d] of positions ``first`` .. ``length - 1``, reusable up to any length whose window they hold (from 0:
    every prefix), or a recurrent state's snapshot, reusable only at exactly ``length``."""

    tensors: tuple[torch.Tensor, ...]
    length: int  # positions saved (a snapshot: the length it was taken at)
    positional: bool = True
    first: int = 0  # the first position saved: a sliding-window layer keeps only the end of a long sequence
    window: int | None = None  # that layer's window (what a query at n reads: n - window + 1 .. n)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def every_prefix(self) -> bool:
        """Whether every length up to :attr:`length` can be taken (positional, saved from position 0)."""
        return self.positional and self.first == 0

    def usable(self, n: int) -> bool:
        """Whether a new sequence may take this layer's first ``n`` positions (a windowed layer: the window before
        position ``n`` saved)."""
        if not self.positional:
            return n == self.length
        return n <= self.length and (self.first == 0 or self.first <= n - (self.window or 1) + 1)


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


# Positions a sliding-window layer keeps past the window its next query reads: a prompt-cache reuse a little short of
# the saved length (prompt_cache.RERUN, a re-rendered last turn) or an undone step still finds its window.
WINDOW_REACH = 16


def window_positions(window: int) -> int:
    """Positions a sliding-window layer's cache holds at most (:class:`LayerCache` ``window``): the ``window - 1``
    its next query reads, :data:`WINDOW_REACH` more, and room to append decode tokens before sliding again (a
    quarter window, 16 at least: a slide copies what it keeps, so decode pays about four positions' copy a token
    where its attention reads ``window``)."""
    return window - 1 + WINDOW_REACH + max(16, window // 4)


def window_layers(cfg: ModelConfig) -> dict[int, int]:
    """Sliding-window attention layers of ``cfg`` by index → their window (recurrent layers are not attention)."""
    if cfg.sliding_window is None:
        return {}
    return {i: cfg.sliding_window for i in cfg.sliding_window_layers if cfg.mixer(i) == "attention"}


class LayerCache:
    """Holds any number of aligned tensors [B, heads, S, d] (k and v, or MLA's latent and rope key).

    ``window`` (a sliding-window layer): it keeps only what a later query can read, at most
    :func:`window_positions`: its buffers hold positions ``first`` .. ``length - 1``, in order, and when an append
    does not fit they *slide* to fresh buffers holding the last ``window - 1 +`` :data:`WINDOW_REACH` positions and
    the new ones. What an update hands back is still a run of consecutive positions whose last T are the new
    queries (only no longer from position 0), so every attention reads it as a prefix, the window's mask relative
    (``attention.attend``); a chunk longer than the buffer attends over its keys joined to the kept ones, a
    temporary. Sliding never writes into the buffers a :meth:`snapshot` refers to, so an undone step gets them
    back."""

    def __init__(self, window: int | None = None) -> None:
        self.buffers: list[torch.Tensor] = []
        self.length = 0
        self.first = 0  # the position at the buffers' index 0 (0 but on a sliding-window layer)
        self.window = window
        self.keep = None if window is None else window - 1 + WINDOW_REACH  # positions a slide keeps

    @property
    def held(self) -> int:
        """Positions in the buffers: ``first`` .. ``length - 1``."""
        return self.length - self.first

    def reserve(self, n: int) -> list[torch.Tensor]:
        """Room for ``n`` positions (buffers made by a first :meth:`append`); the buffers, at full capacity.

        Grown buffers start zeroed: a compiled decode step attends over the whole buffer with the tail masked,
        and a masked-out NaN would still poison the weighted sum (0 * NaN)."""
        if n > self.buffers[0].shape[2]:
            cap = max(2 * self.buffers[0].shape[2], n)
            grown = [b.new_zeros(*b.shape[:2], cap, b.shape[3]) for b in self.buffers]
            for g, b in zip(grown, self.buffers):
                g[:, :, : self.held] = b[:, :, : self.held]
            self.buffers = grown
        return self.buffers

    def append(self, *new: torch.Tensor, capacity_hint: int = 0) -> tuple[torch.Tensor, ...]:
        t = new[0].shape[2]
        if not self.buffers:  # the request's whole length when known: growing copies the cache (twice it, briefly)
            cap = max(64, t, capacity_hint)
            if self.window is not None:
                cap = min(cap, window_positions(self.window))
            self.buffers = [x.new_zeros(*x.shape[:2], cap, x.shape[3]) for x in new]
        at = self.held
        n = at + t
        if n > self.buffers[0].shape[2]:
            if self.window is not None:
                return self._slide(new)
            self.reserve(n)
        for b, x in zip(self.buffers, new):  # narrow: cheaper to dispatch than slice indexing, per decode token
            b.narrow(2, at, t).copy_(x)
        self.length += t
        return tuple([b.narrow(2, 0, n) for b in self.buffers])  # a list, not a generator: one frame, not three

    def _slide(self, new: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """A sliding-window layer whose buffers cannot take ``new``: fresh buffers with the last ``keep`` positions
        and the new ones (what the new queries read); a chunk too long for them attends over the two joined (a
        temporary) and the buffers keep the last ``keep`` of it."""
        assert self.window is not None and self.keep is not None
        t, held = new[0].shape[2], self.held
        old = min(held, self.keep)
        cap = window_positions(self.window)
        fresh = [x.new_zeros(*x.shape[:2], cap, x.shape[3]) for x in new]
        self.length += t
        if old + t <= cap:  # a decode token or a short chunk: one copy of the kept end
            for f, b, x in zip(fresh, self.buffers, new):
                f.narrow(2, 0, old).copy_(b.narrow(2, held - old, old))
                f.narrow(2, old, t).copy_(x)
            self.buffers, self.first = fresh, self.length - old - t
            return tuple([f.narrow(2, 0, old + t) for f in fresh])
        seen = tuple(
            [torch.cat([b.narrow(2, held - old, old), x], dim=2) if old else x for b, x in zip(self.buffers, new)]
        )
        stored = min(self.keep, old + t)
        for f, x in zip(fresh, seen):
            f.narrow(2, 0, stored).copy_(x.narrow(2, old + t - stored, stored))
        self.buffers, self.first = fresh, self.length - stored
        return seen

    def keeps(self, n: int) -> bool:
        """Whether the layer can go on from position ``n`` (<= its length): it holds the window before it."""
        return n <= self.length and (self.window is None or self.first <= max(0, n - (self.window - 1)))

    def start(self, n: int) -> int:
        """The first position a copy of this layer's state at ``n`` keeps (0 but on a sliding-window layer)."""
        return 0 if self.keep is None else max(self.first, n - self.keep)

    def snapshot(self) -> int | tuple[int, int, list[torch.Tensor]]:
        """What :meth:`restore` needs: the length, and on a sliding-window layer where its buffers start and them."""
        return self.length if self.window is None else (self.length, self.first, list(self.buffers))

    def restore(self, saved: int | tuple[int, int, list[torch.Tensor]] | tuple[int, list[torch.Tensor]]) -> None:
        if isinstance(saved, int):
            self.length = saved
            return
        assert len(saved) == 3, "a recurrent layer's snapshot restores a recurrent layer"
        self.length, self.first, self.buffers = saved

    def clear(self) -> None:
        self.buffers, self.length, self.first = [], 0, 0


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

    @staticmethod
    def step_rows(layers: list[RecurrentLayer], x: torch.Tensor) -> Held:
        """One new input each of S sequences' states of one layer (``x`` [S, channels, 1]), stepped as one: the
        windows [S, channels, kernel] and, for "delta", the matrices [S, heads, dk, dv], stacked. Each sequence's
        state then is its row of them (a view: the mixer overwrites the stacked matrices in place, so the new states
        land in every sequence's own with no copy back; the next step stacks them afresh)."""
        spec = layers[0].spec
        for lay in layers:
            if lay.conv is None:  # never stepped (a decode row always follows a prompt; zeros as the reference's)
                lay.append(x.new_zeros(1, spec.channels, 0))
        window = torch.cat([torch.cat([lay.conv for lay in layers if lay.conv is not None]), x], dim=2)
        tails = window[:, :, window.shape[2] - (spec.kernel - 1) :].clone()
        for j, lay in enumerate(layers):
            lay.conv = tails[j : j + 1]
            lay.length += x.shape[2]
        if spec.matrix is None:
            return Held((window,), kind=spec.kind)
        matrix = torch.cat([lay.matrix for lay in layers if lay.matrix is not None])
        for j, lay in enumerate(layers):
            lay.matrix = matrix[j : j + 1]
        return Held((window, matrix), kind=spec.kind)

    def snapshot(self) -> tuple[int, list[torch.Tensor]]:
        return self.length, [t.clone() for t in self.buffers]

    def restore(self, saved: int | tuple[int, int, list[torch.Tensor]] | tuple[int, list[torch.Tensor]]) -> None:
        assert isinstance(saved, tuple) and len(saved) == 2, "a recurrent layer restores its own snapshot"
        self.length, tensors = saved
        self.conv, self.matrix = (tensors + [None, None])[:2] if tensors else (None, None)

    def clear(self) -> None:
        self.conv = self.matrix = None
        self.length = 0


# per layer: an attention layer's length (a sliding-window one's with where its buffers start and them), a recurrent
# layer's copied state
CacheSnapshot = list[int | tuple[int, int, list[torch.Tensor]] | tuple[int, list[torch.Tensor]]]


class KVCache(AttentionState):
    """One sequence's cache, grown per layer as positions arrive (``recurrent``: the layers that keep a recurrent
    state instead, by index; ``windows``: sliding-window layers by index → window, which keep only its end)."""

    def __init__(
        self,
        num_layers: int,
        capacity_hint: int = 0,
        recurrent: dict[int, RecurrentSpec] | None = None,
        windows: dict[int, int] | None = None,
    ):
        recurrent, windows = recurrent or {}, windows or {}
        self.layers: list[LayerCache | RecurrentLayer] = [
            RecurrentLayer(recurrent[i]) if i in recurrent else LayerCache(windows.get(i)) for i in range(num_layers)
        ]
        self.capacity_hint = capacity_hint  # positions the request will reach (prompt + answer), 0: unknown

    def snapshot(self) -> CacheSnapshot:
        """What :meth:`restore` needs to bring the cache back to now: each attention layer's length (its positions
        past it are simply overwritten later; a sliding-window layer's buffers too, which a slide replaces rather
        than overwrites), each recurrent layer's state, copied."""
        return [lay.snapshot() for lay in self.layers]

    def restore(self, saved: CacheSnapshot) -> None:
        """Back to a :meth:`snapshot` of this cache (an undone step)."""
        for lay, s in zip(self.layers, saved):
            lay.restore(s)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` positions (a prompt cache reusing a prefix). A recurrent state holds only its own
        length, a sliding-window layer only the end of the sequence: cutting them where they cannot go on from is
        refused."""
        for lay in self.layers:
            if isinstance(lay, RecurrentLayer) and lay.length != n:
                raise ValueError(f"a recurrent state of {lay.length} positions cannot be cut to {n}")
            if isinstance(lay, LayerCache) and n < lay.length and not lay.keeps(n):
                raise ValueError(
                    f"a sliding-window layer holding positions {lay.first}..{lay.length - 1} cannot be cut to {n} "
                    f"(its window of {lay.window} before position {n} is gone)"
                )
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
        if not 0 < n <= held.length or not held.keeps(n):
            raise ValueError(
                f"layer {layer} holds positions {held.first}..{held.length - 1}; cannot save the state at {n}"
            )
        a = held.start(n)  # a sliding-window layer: the end of the sequence its queries can still read
        tensors = tuple(b.narrow(2, a - held.first, n - a).clone() for b in held.buffers)
        return SavedLayer(tensors, n, first=a, window=held.window)

    def saved_nbytes(self, layer: int, n: int) -> int:
        held = self.layers[layer]
        if isinstance(held, RecurrentLayer):  # a fixed size, whatever the length
            return sum(b.numel() * b.element_size() for b in held.buffers)
        if not held.keeps(n):
            raise ValueError(f"layer {layer} holds positions {held.first}..{held.length - 1}; cannot save {n}")
        return (n - held.start(n)) * sum(b[:, :, :1].numel() * b.element_size() for b in held.buffers)

    def restore_layer(self, layer: int, saved: SavedLayer, n: int) -> None:
        held = self.layers[layer]
        if held.length or not saved.usable(n):
            raise ValueError(f"layer {layer} cannot start from {n} of {saved.length} saved positions")
        if isinstance(held, RecurrentLayer):  # copies: the mixer overwrites its matrix in place
            if saved.positional:
                raise ValueError(f"layer {layer} is recurrent; a positional state cannot start it")
            held.restore((n, [t.clone() for t in saved.tensors]))
            return
        a = saved.first if held.keep is None else max(saved.first, n - held.keep)  # what the layer keeps of it
        if a and held.window is None:
            raise ValueError(f"layer {layer} attends over every position; a sliding window's state cannot start it")
        held.append(*(t.narrow(2, a - saved.first, n - a) for t in saved.tensors), capacity_hint=self.capacity_hint)
        held.first, held.length = a, n


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
