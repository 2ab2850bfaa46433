"""The set of blobs whose checksum already matched in this process: locked, and bounded by LRU."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable


class VerifiedBlobs:
    """Keys of verified blobs. Worker threads of several engines consult it at once (hence the lock), and
    a long-running process reads many stores (hence the bound: the least recently checked key is forgotten,
    so its blob is simply verified again on its next read)."""

    def __init__(self, max_entries: int = 1 << 16):  # ~65k blobs: every expert of a 256-expert, 60-layer model
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, not {max_entries}")
        self.max_entries = max_entries
        self._keys: OrderedDict[Hashable, None] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            if key not in self._keys:
                return False
            self._keys.move_to_end(key)
            return True

    def add(self, key: Hashable) -> None:
        with self._lock:
            self._keys[key] = None
            self._keys.move_to_end(key)
            while len(self._keys) > self.max_entries:
                self._keys.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)
