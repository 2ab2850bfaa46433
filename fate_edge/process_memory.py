"""This process's memory as the kernel counts it (no torch: peer processes import it before their runtime)."""

from __future__ import annotations

import resource
import sys


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (the kernel's high-water mark, not a sample).

    Linux: VmHWM of this address space. getrusage's ru_maxrss is kept across execve, so in a child
    started by a big parent it reports the parent's size; VmHWM starts afresh with the new program.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
