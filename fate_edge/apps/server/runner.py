"""Generation jobs on worker threads, one per place in the engine's batch, with a bounded queue and cancellation
between tokens.

The event loop never runs the model: a job's tokens travel from its worker thread to the request's
``asyncio.Queue`` through ``call_soon_threadsafe``. With a batching engine (``max_batch`` > 1) up to that many jobs
stream at once, their sequences stepped together by the engine. A job whose client went away is stopped before its
next token (or skipped if it had not started): its sequence leaves the batch and the others go on.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fate_edge.apps.server.errors import QueueFull
from fate_edge.runtime.generate import GenerateConfig, GenerationResponse
from fate_edge.runtime.scheduler import SchedulerStats
from fate_edge.sdk import recover


@dataclass
class Token:
    """One generated token."""

    step: GenerationResponse


@dataclass
class Failed:
    """The request ended in an error."""

    error: BaseException


@dataclass
class End:
    """The request ended (finished, cancelled or out of tokens)."""


Event = Token | Failed | End  # what a job's queue carries, in order


@dataclass
class Job:
    prompt: str | list[int]
    config: GenerateConfig
    loop: asyncio.AbstractEventLoop
    id: int = 0
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    state: str = "queued"  # queued | running | done | cancelled | failed
    submitted_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    stats: SchedulerStats | None = None
    last: GenerationResponse | None = None

    def emit(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening any more
            self.cancel.set()


class Runner:
    """Runs up to ``engine.max_batch`` jobs at once (one without batching); at most ``max_queue`` wait behind them."""

    def __init__(self, engine: Any, max_queue: int, on_finish=None):
        self.engine = engine
        self.max_queue = max_queue
        self.slots = max(1, int(getattr(engine, "max_batch", 1)))  # jobs served together
        self.on_finish = on_finish  # callable(job) on the worker thread when a job ends, for metrics
        self._executor = ThreadPoolExecutor(max_workers=self.slots, thread_name_prefix="fate-edge-generate")
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.outstanding = 0  # running + waiting
        self.running = 0

    @property
    def waiting(self) -> int:
        return self.outstanding - self.running

    def submit(self, job: Job) -> Job:
        with self._lock:
            if self.outstanding >= self.max_queue + self.slots:
                raise QueueFull(f"{self.waiting} requests are already waiting (--max-queue {self.max_queue})")
            self.outstanding += 1
            job.id = next(self._ids)
        try:
            self._executor.submit(self._run, job)
        except RuntimeError:  # shut down
            with self._lock:
                self.outstanding -= 1
            raise
        return job

    def _run(self, job: Job) -> None:
        try:
            if job.cancel.is_set():
                job.state = "cancelled"
                job.emit(End())
                return
            with self._lock:
                self.running += 1
            job.state, job.started_at = "running", time.perf_counter()
            steps = self.engine.stream(job.prompt, job.config)
            try:
                for step in steps:
                    job.stats = self.engine.request_stats  # this request's, read while it holds the engine
                    job.last = step
                    job.emit(Token(step))
                    if job.cancel.is_set():
                        job.state = "cancelled"
                        break
            finally:
                steps.close()  # releases the engine at once when cancelled mid-stream
            if job.state == "running":
                job.state = "done"
            job.emit(End())
        except Exception as exc:
            job.state = "failed"
            try:
                recover(self.engine)
            finally:
                job.emit(Failed(exc))
        finally:
            with self._lock:
                self.outstanding -= 1
                if job.started_at is not None:
                    self.running -= 1
            if self.on_finish is not None:
                try:
                    self.on_finish(job)
                except Exception:  # metrics must never take the worker down
                    pass

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=False)
