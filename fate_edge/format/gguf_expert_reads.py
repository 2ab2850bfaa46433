"""A GGUF's routed experts read for convert in large sequential reads, ahead of the encoders.

Each layer's experts are stacked, one tensor per matrix (``blk.N.ffn_{gate,up,down}_exps``). Reading one expert
at a time is three reads of a few MB at three places, from several encoder threads in no particular order, which
the kernel's readahead cannot follow. Here one reader thread goes through the experts in the order convert
encodes them, a run of consecutive experts at a time: per run one read of each stacked tensor (gate, up, down), so
each tensor is read front to back, in requests of about READ_BYTES, O_DIRECT where the filesystem allows
(:mod:`direct_read`). It reads ahead of the experts asked for while it holds at most AHEAD_BYTES, and always reads
a run an encoder waits for, so memory stays a few runs' worth whatever the model's size.
"""

from __future__ import annotations

import functools
import threading

import numpy as np

from fate_edge.format.direct_read import DirectReader
from fate_edge.format.gguf_reader import GGUFFile
from fate_edge.format.gguf_tensors import expert_tensor
from fate_edge.format.store import MATRICES

READ_BYTES = 16 << 20  # one request per stacked tensor and run (dd reads this VM's disk at full speed in 16 MB)
AHEAD_BYTES = 128 << 20  # runs read before an encoder asks for them, held at most


class ExpertReads:
    """``expert(layer, e)``: expert ``e`` of layer ``layer`` as its raw bytes per matrix, read with its run.
    ``close()`` stops the reader thread (any run not handed out yet is dropped)."""

    def __init__(
        self,
        g: GGUFFile,
        layers: list[int],
        experts: int,
        read_bytes: int | None = None,  # None: READ_BYTES
        ahead_bytes: int | None = None,  # None: AHEAD_BYTES
    ):
        read_bytes = READ_BYTES if read_bytes is None else read_bytes
        self.g, self.experts = g, experts
        self.ahead_bytes = AHEAD_BYTES if ahead_bytes is None else ahead_bytes
        self.per = {(layer, m): g.info(expert_tensor(layer, m)).nbytes // experts for layer in layers for m in MATRICES}
        widest = max(self.per.values(), default=1)
        self.run = max(1, min(experts, read_bytes // max(widest, 1)))  # experts per run
        self.runs = [(layer, a, min(a + self.run, experts)) for layer in layers for a in range(0, experts, self.run)]
        self._at = {(layer, a): i for i, (layer, a, _) in enumerate(self.runs)}
        self._cond = threading.Condition()
        self._ready: dict[int, dict[str, np.ndarray]] = {}  # runs read and not yet handed out in full
        self._left: dict[int, int] = {}  # experts of each ready run not handed out yet
        self._held = 0  # bytes of the ready runs
        self._read = 0  # runs read so far
        self._wanted = -1  # the furthest run an encoder has asked for
        self._error: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None

    def expert(self, layer: int, e: int) -> dict[str, np.ndarray]:
        """The raw bytes of each matrix of expert ``e`` ([bytes of one expert] uint8, a copy of its own)."""
        i = self._at[(layer, e - e % self.run)]
        with self._cond:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._reader, name="convert-read", daemon=True)
                self._thread.start()
            if i > self._wanted:
                self._wanted = i
                self._cond.notify_all()
            self._cond.wait_for(lambda: i in self._ready or i < self._read or self._error is not None or self._closed)
            if i not in self._ready:
                if self._error is not None:
                    raise self._error
                raise RuntimeError("reads closed" if self._closed else f"layer {layer} expert {e} asked for twice")
            run = self._ready[i]
            self._left[i] -= 1
            if self._left[i] == 0:  # the last expert of the run: its buffers go once copied below
                del self._ready[i], self._left[i]
                self._held -= sum(a.nbytes for a in run.values())
                self._cond.notify_all()
        first = self.runs[i][1]
        return {m: run[m][e - first].copy() for m in MATRICES}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        self._ready.clear()

    def _size(self, i: int) -> int:
        layer, a, b = self.runs[i]
        return sum(self.per[(layer, m)] for m in MATRICES) * (b - a)

    def _may_read(self, i: int, size: int) -> bool:
        return self._closed or i <= self._wanted or self._held + size <= self.ahead_bytes

    def _reader(self) -> None:
        f = None
        try:
            f = DirectReader(self.g.path)
            for i, (layer, a, b) in enumerate(self.runs):
                size = self._size(i)
                with self._cond:  # asked for, or room to read ahead
                    self._cond.wait_for(functools.partial(self._may_read, i, size))
                    if self._closed:
                        return
                run = {}
                for m in MATRICES:  # each stacked tensor front to back, one request per run
                    info, per = self.g.info(expert_tensor(layer, m)), self.per[(layer, m)]
                    run[m] = f.read(info.offset + a * per, (b - a) * per).reshape(b - a, per)
                with self._cond:
                    self._ready[i], self._left[i] = run, b - a
                    self._held += size
                    self._read = i + 1
                    self._cond.notify_all()
        except BaseException as exc:  # raised in the encoders waiting for a run
            with self._cond:
                self._error = exc
                self._cond.notify_all()
        finally:
            if f is not None:
                f.close()
