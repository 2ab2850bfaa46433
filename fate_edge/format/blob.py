"""One blob of the expert store: where it lives (``BlobRef``, aligned to ``ALIGN``) and how its bytes are checked
(a CRC32 per blob, remembered once matched in this process)."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

from fate_edge.errors import CorruptBlobError, FetchError
from fate_edge.format.checksum import crc32

ALIGN = 4096  # blobs start on, and O_DIRECT reads whole, 4 KiB blocks


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


@dataclass(frozen=True)
class BlobRef:
    """Where one expert's blob lives."""

    path: str
    offset: int  # multiple of ALIGN
    length: int  # payload bytes
    crc32: int
    layer: int
    expert: int
    bits: int

    @property
    def read_length(self) -> int:
        return -(-self.length // ALIGN) * ALIGN  # O_DIRECT reads whole aligned blocks

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.layer, self.expert, self.bits)

    def where(self) -> str:
        return f"layer {self.layer} expert {self.expert} (int{self.bits}) in {self.path} at offset {self.offset}"


# Blobs whose CRC matched in this process, keyed by the file's identity (device, inode, mtime) and offset:
# a store rewritten by `fate-edge convert` is a new file, so nothing verified in the old one carries over.
# Shared by every engine of the process (so a blob is checked once), locked, and bounded (LRU).
VERIFIED_BLOBS = VerifiedBlobs()


def file_identity(fd: int) -> tuple[int, int, int]:
    """(device, inode, mtime) of an open file: what ``VERIFIED_BLOBS`` keys a blob's file by."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino, st.st_mtime_ns


def truncated(ref: BlobRef, got: int) -> FetchError:
    return FetchError(
        f"{ref.where()}: file ends early (read {got} of {ref.length} bytes); "
        "the store is truncated, re-run fate-edge convert"
    )


def corrupted(ref: BlobRef) -> CorruptBlobError:
    return CorruptBlobError(
        f"checksum mismatch for {ref.where()}: the expert store is corrupted; re-run fate-edge convert to rebuild it"
    )


def mark_verified(ref: BlobRef, payload: bytes, identity: tuple[int, int, int]) -> None:
    """Check ``payload`` (``ref``'s bytes, read from the file whose :func:`file_identity` is ``identity``)
    against its CRC; on success its later reads in this process skip the check."""
    if len(payload) != ref.length:
        raise truncated(ref, len(payload))
    if crc32(payload) != ref.crc32:
        raise corrupted(ref)
    VERIFIED_BLOBS.add((*identity, ref.offset))
