"""A link model that throttles reads to a device profile's bandwidth and latency.

A run on this machine's fast disk (or page cache) then moves bytes at the speed of, say, a Jetson Orin
Nano's NVMe or an SD card. One link is shared by every reader thread: each transfer reserves the link
for ``bytes / bandwidth`` seconds after the previous reservation, so concurrent readers split the
bandwidth instead of each getting all of it; the per-request latency is paid once per request.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class LinkSpec:
    name: str
    bandwidth_bytes_per_s: float
    latency_s: float = 0.0

    def transfer_time(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


class ThrottledLink:
    """Token-bucket style throttle: call :meth:`reserve` after reading a chunk; it sleeps as needed."""

    def __init__(self, spec: LinkSpec):
        if spec.bandwidth_bytes_per_s <= 0:
            raise ValueError(f"link '{spec.name}': bandwidth must be > 0, got {spec.bandwidth_bytes_per_s}")
        self.spec = spec
        self._lock = threading.Lock()
        self._free_at = 0.0  # monotonic time at which the link finishes its reserved transfers
        self.bytes_moved = 0

    def reserve(self, nbytes: int, first_chunk: bool = False, issued_at: float | None = None) -> float:
        """Account ``nbytes`` on the link; block until they would have arrived. Returns seconds slept.

        ``issued_at``: ``time.monotonic()`` when the request these bytes belong to began reading. The
        emulated transfer then overlaps the real read and the request's chunks follow each other on the
        link back to back, as one device command would. Without it the transfer starts *now*, after the
        chunk was read, so a caller that reserves after each chunk pays read time + link time + every
        sleep overshoot per chunk, and a stream delivers far below the link's bandwidth (docs/measured-choices.md).
        """
        with self._lock:
            now = time.monotonic()
            start = max(now if issued_at is None else min(issued_at, now), self._free_at)
            if first_chunk:
                start += self.spec.latency_s
            self._free_at = start + nbytes / self.spec.bandwidth_bytes_per_s
            done_at = self._free_at
            self.bytes_moved += nbytes
        delay = done_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        return max(0.0, delay)


def storage_link(profile) -> LinkSpec:
    """The link experts stream over on ``profile`` (a :class:`devices.profile.DeviceProfile`): its storage."""
    return LinkSpec(f"{profile.name} storage", profile.storage_read_gbps * 1e9, profile.storage_latency_us * 1e-6)


def host_to_accelerator_link(profile) -> LinkSpec | None:
    """Host → GPU copies (PCIe); None on unified-memory devices, where there is no such hop."""
    if profile.host_link_gbps is None:
        return None
    return LinkSpec(f"{profile.name} host link", profile.host_link_gbps * 1e9, 0.0)
