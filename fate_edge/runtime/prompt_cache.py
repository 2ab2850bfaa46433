"""The prompt cache: finished requests' attention state kept by their tokens; a new request prefills only what is new.

When a request ends, its state (every layer's ``kv_cache.AttentionState.save_layer``: keys and values, MLA's latent,
or a recurrent state's snapshot) is kept under the tokens it holds, least recently used evicted first, inside a room
of ``room_bytes`` that the memory account declares as its own part (``MemoryAccount.prompt_cache``), so the budget
covers it: the cache never holds more (an entry that does not fit even alone keeps only the prefix that fits, or is
not kept). A new request starts from the entry sharing the longest prefix with its prompt, short of its last
:data:`RERUN` tokens, which always run again (the last one's logits pick the first token). A chat's next turn thus
prefills only its new message. The reused positions were computed in an earlier step: the same values where the
kernels do not depend on what ran beside them (the suite's greedy texts are the same on and off,
tests/test_prompt_cache.py); int4 experts round an expert's rows differently by how many run together, so a near tie
can tip (llama-server's cache_prompt has the same caveat): ``cache_prompt`` False where answers must be reproducible
to the bit. Reuse of positional state may stop anywhere inside an entry; a sliding-window layer's (which keeps only
its window's end) only where that still holds the window; a recurrent layer's snapshot only at exactly its length
(``SavedLayer.usable``), so an entry holding one is reused whole or not at all.

The batcher (``runtime.batch``) and a request served alone (``generate.stream_from_model``, a batch of one) both call
:meth:`PromptCache.restore` when a sequence starts and :meth:`PromptCache.keep` when it ends; a request with
``GenerateConfig.cache_prompt`` False does neither.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from fate_edge.model.kv_cache import AttentionState, SavedLayer
from fate_edge.runtime.budget import parse_bytes

# Prompt tokens a hit runs again, at least: the last one's logits pick the first token, and two run as a prompt (one
# alone would run as a decode step, whose int4 expert kernel rounds differently from a prompt's: the greedy text
# with the cache on would differ from the text without it)
RERUN = 2
# "auto": room for this many full contexts (context_tokens) of keys and values: a conversation's whole state
AUTO_CONTEXTS = 1


def prompt_cache_room(setting: int | str, kv_bytes_per_token: int, context_tokens: int, fixed_bytes: int = 0) -> int:
    """The room in bytes for ``EngineConfig.prompt_cache``: "auto" (:data:`AUTO_CONTEXTS` contexts of KV, each with
    a sequence's ``fixed_bytes``: recurrent states, sliding windows' rings), a size ("256MB") or bytes; 0 turns the
    cache off."""
    if isinstance(setting, str) and setting.strip().lower() == "auto":
        return AUTO_CONTEXTS * (kv_bytes_per_token * context_tokens + fixed_bytes)
    try:
        room = parse_bytes(setting)
    except ValueError as exc:
        raise ValueError(f"prompt_cache: {exc}, or auto (0 turns it off)") from None
    if room < 0:
        raise ValueError(f"prompt_cache must be >= 0 bytes (0 turns it off), got {setting!r}")
    return room


@dataclass
class PromptCacheStats:
    hits: int = 0  # requests that started from a kept prefix
    misses: int = 0  # requests that looked and found none
    tokens_saved: int = 0  # prompt tokens not prefilled thanks to a hit
    kept: int = 0  # entries stored
    evictions: int = 0  # entries dropped for room
    bytes_held: int = 0
    entries: int = 0


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    layers: list[SavedLayer]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.layers)

    @property
    def every_prefix(self) -> bool:
        """Whether it serves every prefix of its tokens (no recurrent snapshot, no sliding window's end)."""
        return all(s.every_prefix for s in self.layers)

    def usable(self, n: int) -> bool:
        return all(s.usable(n) for s in self.layers)


def _common(a: tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PromptCache:
    """Kept states by their tokens, LRU, at most ``room_bytes`` held (thread-safe)."""

    def __init__(self, room_bytes: int, num_layers: int):
        if room_bytes <= 0:
            raise ValueError(f"a prompt cache needs a room of at least one byte, got {room_bytes}")
        self.room_bytes = room_bytes
        self.num_layers = num_layers
        self.stats = PromptCacheStats()
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    @property
    def bytes_held(self) -> int:
        return self.stats.bytes_held

    def _match(self, prompt: list[int]) -> tuple[_Entry | None, int]:
        """The entry giving the most reusable positions of ``prompt``, and how many: never its last
        :data:`RERUN` tokens."""
        best, best_n = None, 0
        limit = len(prompt) - RERUN
        for entry in self._entries.values():
            n = min(_common(entry.tokens, prompt), limit)
            if n > best_n and entry.usable(n):
                best, best_n = entry, n
        return best, best_n

    def restore(self, state: AttentionState, prompt: list[int]) -> int:
        """Start the empty ``state`` of a new sequence from the longest kept prefix of ``prompt`` → positions reused
        (0: none; the caller prefills from there)."""
        with self._lock:
            entry, n = self._match(prompt)
            if entry is None:
                self.stats.misses += 1
                return 0
            self._entries.move_to_end(entry.tokens)
            for layer, saved in enumerate(entry.layers):
                state.restore_layer(layer, saved, n)
            self.stats.hits += 1
            self.stats.tokens_saved += n
            return n

    def keep(self, state: AttentionState, tokens: list[int]) -> bool:
        """Keep ``state``, which holds ``tokens`` (its positions, in order), evicting the least recently used entries
        first so the room is never exceeded, even while copying. An entry that is a prefix of another positional
        one is redundant: the longer one serves it. An entry too big for the room alone keeps the prefix that fits
        (a recurrent snapshot cannot be cut: not kept)."""
        n = len(tokens)
        key = tuple(tokens)
        try:
            size = sum(state.saved_nbytes(i, n) for i in range(self.num_layers))
            if size > self.room_bytes:  # a sliding window cannot go back that far: saved_nbytes says so
                n = self.room_bytes * n // size
                key, size = key[:n], sum(state.saved_nbytes(i, n) for i in range(self.num_layers))
        except (NotImplementedError, ValueError):
            return False
        if n < 2 or size > self.room_bytes:
            return False
        with self._lock:
            for other in self._entries.values():  # already served by a kept, longer prefix
                if other.every_prefix and _prefix_of(key, other.tokens):
                    self._entries.move_to_end(other.tokens)
                    return False
            while self._entries and self.stats.bytes_held + size > self.room_bytes:
                self._drop(next(iter(self._entries)))
                self.stats.evictions += 1
            try:  # a recurrent kind saves only at its own length: a cut-short snapshot is refused there
                entry = _Entry(key, [state.save_layer(i, n) for i in range(self.num_layers)])
            except (NotImplementedError, ValueError):
                return False
            if entry.every_prefix:  # it serves every prompt a kept prefix of it did
                for k in [k for k, e in self._entries.items() if e.every_prefix and _prefix_of(k, key)]:
                    self._drop(k)
            self._entries[key] = entry
            self.stats.bytes_held += entry.nbytes
            self.stats.kept += 1
            self.stats.entries = len(self._entries)
            return True

    def _drop(self, key: tuple[int, ...]) -> None:
        entry = self._entries.pop(key)
        self.stats.bytes_held -= entry.nbytes
        self.stats.entries = len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.stats.bytes_held = self.stats.entries = 0


def _prefix_of(short: tuple[int, ...], long: tuple[int, ...]) -> bool:
    return len(short) <= len(long) and long[: len(short)] == short
