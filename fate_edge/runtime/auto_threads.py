"""Torch's CPU threads when the user names none ("auto", the default everywhere).

While experts stream from the store, one thread per core less the fetch workers (``devices.detect.thread_split``): a
reader left without a core stalls OpenMP's barriers. Once the load has read a model its budget holds whole, the
workers have nothing left to read, and a real model's decode and prefill gain from every core
(docs/measured-choices.md); a narrow model's (the bundled one's) operators are too small to split, and a second
thread only adds barriers.
"""

from __future__ import annotations

import torch

from fate_edge.devices.detect import available_cores, thread_split
from fate_edge.runtime.compute_dtype import WIDE

AUTO = "auto"


def auto_threads(cores: int, streams: bool, hidden_size: int, device: str) -> int:
    """Torch threads for an engine on ``cores``: every core where nothing streams after the load on a CPU and the
    model is at least :data:`~fate_edge.runtime.compute_dtype.WIDE` wide, else the cores less the fetch workers."""
    if not streams and device == "cpu" and hidden_size >= WIDE:
        return max(1, cores)
    return thread_split(cores)[0]


def set_load_threads(threads: int | str | None) -> None:
    """Before a load: ``threads`` where it is a number, the streaming count for "auto", torch's as it is for None."""
    if threads == AUTO:
        torch.set_num_threads(thread_split()[0])
    elif threads:
        torch.set_num_threads(int(threads))


def settle_threads(threads: int | str | None, streams: bool, hidden_size: int, device: str) -> int:
    """After a load with ``threads`` "auto": the count for what the engine does now (:func:`auto_threads`; ``streams``:
    whether it still reads experts), set for the threads that compute from here on (a batcher's starts with it).
    Returns torch's thread count."""
    if threads == AUTO:
        torch.set_num_threads(auto_threads(available_cores(), streams, hidden_size, device))
    return torch.get_num_threads()
