"""A prompt's temporaries from the heap, on engines where nothing expert-sized goes through malloc after load.

Opening a store fixes glibc's mmap threshold at 1 MiB (``format.store.return_freed_blobs_to_the_os``: blobs freed
into the heap stayed resident). Every temporary of a prefill chunk of 1 MiB or more is then a mapping of its own,
faulted in page by page and unmapped when freed: a fifth of an 8-layer prompt's time went to the kernel's page
faults (docs/cpu-profile.md). An engine whose experts are its read pool's own mappings, decoded in place and kept
or lent as they are (``Scheduler.zero_copy`` or ``lends``, every precision of the store decoding to views), allocates
nothing expert-sized after load, so there the threshold rises to glibc's largest and a chunk's temporaries are
served again from memory freed by the last one. The heap fragments as chunks come and go, so the memory account
holds more for a chunk's activations on such a store (``memory_account.buffer_bytes``).

Process-wide, as glibc's setting is: raised only while no open engine copies experts into memory of their own, and
set back to 1 MiB when the last engine that raised it closes.
"""

from __future__ import annotations

import threading
import weakref

from fate_edge.format.store import ExpertStore, decodes_to_views, return_freed_blobs_to_the_os, set_mmap_threshold

HEAP_MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit (half its heap size); larger temporaries stay mappings


class Claim:
    """An engine's say in the threshold, held apart from the engine (its finalizer must not hold the engine)."""

    __slots__ = ("__weakref__",)


_lock = threading.Lock()
_raised: weakref.WeakSet = weakref.WeakSet()  # open engines that raised the threshold
_copying: weakref.WeakSet = weakref.WeakSet()  # open engines that copy experts into memory of their own


def views_only(store: ExpertStore) -> bool:
    """Whether every precision of ``store`` decodes on this host to views of its blob (no expert-sized copies)."""
    return all(decodes_to_views(p) for p in store.precisions.values())


def serve_from_heap(owner: Claim, keeps_buffers: bool, store: ExpertStore) -> bool:
    """After ``owner``'s engine has loaded: raise glibc's mmap threshold if its experts stay in their read buffers
    (``keeps_buffers``) on a store of views only and no other open engine copies experts; otherwise note it as
    copying, so that no engine raises the threshold while it is open. Returns whether the threshold is raised."""
    with _lock:
        if not (keeps_buffers and views_only(store)):
            _copying.add(owner)
            if _raised:
                return_freed_blobs_to_the_os()  # back to 1 MiB: this engine's copies must leave the heap when freed
                _raised.clear()
            return False
        if _copying or not set_mmap_threshold(HEAP_MMAP_THRESHOLD):
            return False
        _raised.add(owner)
        return True


def engine_closed(owner: Claim) -> None:
    """``owner``'s engine closed: the threshold back to 1 MiB when it was the last engine that raised it."""
    with _lock:
        _copying.discard(owner)
        if owner in _raised:
            _raised.discard(owner)
            if not _raised:
                return_freed_blobs_to_the_os()
