"""Progress of a conversion made on first use, where a person can watch it: lines with bytes, rate and time left
(a terminal gets convert's own bar instead), and a :class:`LoadStatus` the daemon's ``/health`` reports."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fate_edge.sizes import format_bytes


@dataclass
class LoadStatus:
    """Where a model's loading is: ``stage`` is starting, converting, planning or loading; ``progress`` the share
    of the stage done (None where it is not measured); ``detail`` the last progress line."""

    stage: str = "starting"
    progress: float | None = None
    detail: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def set(self, stage: str, progress: float | None = None, detail: str = "") -> None:
        with self.lock:
            self.stage, self.progress, self.detail = stage, progress, detail

    def snapshot(self) -> dict:
        with self.lock:
            out: dict = {"stage": self.stage, "progress": None if self.progress is None else round(self.progress, 4)}
            if self.detail:
                out["detail"] = self.detail
            return out


class ProgressLines:
    """``on_progress(done, total)`` for convert: a line to ``emit`` at most every ``every`` seconds, and at the end,
    "converting NAME: 42% (8.4 of 20.1 MB, RATE MB/s, about N s left)"; ``status`` follows every call."""

    def __init__(
        self,
        name: str,
        emit: Callable[[str], None] | None,
        every: float = 5.0,
        status: LoadStatus | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.name, self.emit, self.every, self.status, self.clock = name, emit, every, status, clock
        self.t0 = clock()
        self.last = self.t0

    def line(self, done: int, total: int) -> str:
        elapsed = max(self.clock() - self.t0, 1e-9)
        rate = done / elapsed
        left = f"about {(total - done) / rate:.0f} s left" if rate > 0 and done < total else "done"
        share = 100 * done / total if total else 100.0
        return (
            f"converting {self.name}: {share:.0f}% ({format_bytes(done)} of {format_bytes(total)}, "
            f"{format_bytes(int(rate))}/s, {left})"
        )

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        text = None
        if self.emit is not None and (now - self.last >= self.every or done >= total):
            self.last = now
            text = self.line(done, total)
            self.emit(text)
        if self.status is not None:
            self.status.set("converting", done / total if total else 1.0, text or self.status.detail)
