"""Continuous batching: requests join and leave between steps, and each step is one forward over every active sequence.

A worker thread owns the steps, and any other computation of the engine (:meth:`Batcher.call`). Each step stacks,
per active sequence, either its next prompt chunk (a joining request; all joining requests' chunks together at most
``prompt_rows`` tokens a step) or its last sampled token, and runs them in one pass
(``model.batch_step.forward_segments``): per MoE layer the scheduler sees the union of the batch's routed experts,
reads each once and the model computes each on its rows, grouped. Every sequence keeps
its own KV cache, sampling, stop conditions and statistics (:class:`~fate_edge.runtime.generate.TokenStream`).

The KV caches are inside the budget: every sequence reserves its prompt plus answer at admission as a range of one
KV slab of ``kv_budget_bytes`` (the memory account's KV room; ``model.kv_slab``), which also lets a step's decode
tokens attend in one operator per layer. A request that cannot fit now waits; one that could never
fit is refused with :class:`KVRoomError` (a BudgetError). A sequence leaves when it finishes, when its reader
closes the stream, or when its reader stops reading for ``idle_timeout`` seconds; the others go on untouched.
A finished sequence's state is kept in the prompt cache (``runtime.prompt_cache``, its own room of the budget), and
a joining one starts from its prompt's longest kept prefix.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, TypeVar

import torch

from fate_edge.errors import DeviceMemoryError, EngineClosedError, FetchError, KVRoomError, StreamSupersededError
from fate_edge.model.batch_step import forward_segments
from fate_edge.model.kv_slab import KVSlab, SlabCache
from fate_edge.runtime.generate import (
    PREFILL_CHUNK,
    GenerateConfig,
    GenerationResponse,
    Sequence,
    TokenStream,
    prepare_prompt,
)
from fate_edge.runtime.scheduler import SchedulerStats
from fate_edge.sizes import format_bytes

# KV positions a sequence reserves past its prompt when it joins; its range grows as its answer is written, so an
# answer of unknown length (no max_tokens) does not hold the whole context from the start
ANSWER_ROOM = 256
GROW_STEP = 64  # positions a range grows by when its answer reaches its end
T = TypeVar("T")

if TYPE_CHECKING:
    from fate_edge.model.kv_cache import KVCache
    from fate_edge.model.transformer import MoETransformer
    from fate_edge.runtime.prompt_cache import PromptCache
    from fate_edge.runtime.scheduler import Scheduler
    from fate_edge.tokenizer import Tokenizer


def default_max_batch(device: str) -> int:
    """Sequences per step when none is given: 8 on a CPU (a step's cost is mostly per operator, so 8 rows cost little
    more than one), 16 on a GPU."""
    return 16 if device.startswith("cuda") else 8


@dataclass
class BatchConfig:
    max_batch: int = 8  # sequences per step
    kv_budget_bytes: int = 0  # KV room for all sequences together (0: no limit)
    kv_bytes_per_token: int = 0  # one position's keys and values over the layers that grow with the length
    prompt_rows: int = PREFILL_CHUNK  # joining prompts' tokens per step, all together
    idle_timeout: float = 30.0  # seconds a stream may leave tokens unread before its sequence is removed
    prompt_cache: PromptCache | None = None  # finished sequences' states, reused by later prompts (None: off)
    # one sequence's fixed-size state (short convolutions, DeltaNet, sliding-window layers' rings:
    # memory_account.state_bytes) drawn from the same budget: the slab is what the batch's states leave of it
    state_bytes: int = 0


@dataclass
class BatchStats:
    """What the batch has done since it started (read by /metrics and the bench)."""

    steps: int = 0
    rows: int = 0  # tokens run (prompt and decode)
    sequences_stepped: int = 0  # sum over steps of the sequences in the step (mean batch = this / steps)
    tokens: int = 0  # tokens generated
    active: int = 0  # sequences in the batch now
    peak_active: int = 0  # the most sequences the batch has held at once
    waiting: int = 0  # admitted to the queue, not yet in the batch
    kv_reserved_bytes: int = 0


class BatchSequence(Sequence):
    """One request in the batch (a :class:`~fate_edge.runtime.generate.Sequence`, stepped as one alone is), with
    its statistics and its reader's queue."""

    def __init__(
        self,
        seq_id: int,
        prompt_ids: list[int],
        config: GenerateConfig,
        out: TokenStream,
        cache: KVCache | None,
        kv_bytes: int,
    ):
        super().__init__(prompt_ids, config, out, cache)  # the cache is made at admission (a range of the KV slab)
        self.id = seq_id
        self.kv_bytes = kv_bytes
        self.events: queue.SimpleQueue = queue.SimpleQueue()  # GenerationResponse or an exception
        self.cancelled = threading.Event()
        self.done = False
        self.stats = SchedulerStats()  # this sequence's share of each step it took part in
        self.unread = 0
        self.last_read = time.monotonic()

    def put(self, item: GenerationResponse | BaseException) -> None:
        self.unread += 1
        self.events.put(item)


def share(delta: SchedulerStats, fraction: float) -> SchedulerStats:
    """``fraction`` of a step's statistics: one sequence's part of what the step read and waited for."""
    out = SchedulerStats()
    for f in fields(SchedulerStats):
        v = getattr(delta, f.name) * fraction
        setattr(out, f.name, round(v) if isinstance(getattr(delta, f.name), int) else v)
    return out


def add_stats(into: SchedulerStats, more: SchedulerStats) -> None:
    for f in fields(SchedulerStats):
        setattr(into, f.name, getattr(into, f.name) + getattr(more, f.name))


class Batcher:
    """Serves :meth:`stream` calls from any thread together, one batched forward per step, on its own thread."""

    def __init__(
        self,
        model: MoETransformer,
        tokenizer: Tokenizer,
        scheduler: Scheduler,
        lock: threading.Lock,
        config: BatchConfig,
    ):
        if config.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {config.max_batch}")
        self.model = model
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.lock = lock  # the engine's: one step of anything at a time
        self.config = config
        self.stats = BatchStats()
        self._ids = itertools.count(1)
        self._cv = threading.Condition()
        self._waiting: deque[BatchSequence] = deque()
        self._active: list[BatchSequence] = []
        self._calls: deque[tuple[Callable[[], object], Future]] = deque()  # work run between steps (call)
        self._closed = False
        self._thread: threading.Thread | None = None
        self._slab: KVSlab | None = None
        c = config
        if c.kv_budget_bytes and c.kv_bytes_per_token:  # made (and zeroed) now, not inside the first request's prefill
            states = c.state_bytes * c.max_batch  # every sequence's recurrent states, at most, beside the slab
            self._slab = KVSlab(model, max(1, (c.kv_budget_bytes - states) // c.kv_bytes_per_token))
        self._starved = False  # a sequence could not grow its KV range last step: admit no one until it can

    # ----------------------------------------------------------------- callers
    def submit(self, prompt: str | list[int], config: GenerateConfig | None = None) -> BatchSequence:
        """Check the request (bad input raises here, in the caller's thread) and queue it to join the batch."""
        config = config or GenerateConfig()
        prompt_ids, max_tokens = prepare_prompt(self.model, self.tokenizer, prompt, config)
        kv = self.config.kv_bytes_per_token * (len(prompt_ids) + max_tokens) + self.config.state_bytes
        c = self.config
        if c.kv_budget_bytes and kv > c.kv_budget_bytes:
            raise KVRoomError(
                f"this request needs {format_bytes(kv)} of KV cache ({len(prompt_ids)} prompt + {max_tokens} answer "
                f"tokens) but the budget holds {format_bytes(c.kv_budget_bytes)} for all sequences together; "
                "lower max_tokens or shorten the prompt, or raise --context-tokens"
            )
        out = TokenStream(self.tokenizer, prompt_ids, config, max_tokens)
        seq = BatchSequence(next(self._ids), prompt_ids, config, out, None, kv)
        if max_tokens == 0:  # nothing to generate: answered without joining
            seq.put(out.response("", None, "length"))
            seq.done = True
            return seq
        with self._cv:
            if self._closed:
                raise EngineClosedError("the engine is closed; create a new Engine to serve more requests")
            self._waiting.append(seq)
            self.stats.waiting = len(self._waiting)
            self._wake()
        return seq

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` run on the batcher's thread between two steps, waited for: its result, or its exception raised
        here. Other computations of a batched engine (a prompt's scoring) go through here so that the batcher's
        thread stays the only one computing with several threads: libgomp keeps a team of helper threads for each
        thread that ran a parallel region, and with more of them than CPUs it cuts every team's spin-waiting
        (runtime.load_threads)."""
        if self._thread is threading.current_thread():
            return fn()
        done: Future = Future()
        with self._cv:
            if self._closed:
                raise EngineClosedError("the engine is closed; create a new Engine to serve more requests")
            self._calls.append((fn, done))
            self._wake()
        return done.result()

    def _wake(self) -> None:
        """Start the worker on first use and wake it (under ``_cv``)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="fate-edge-batch", daemon=True)
            self._thread.start()
        self._cv.notify_all()

    def responses(self, seq: BatchSequence) -> Iterator[GenerationResponse]:
        """``seq``'s responses as they come; closing the iterator removes it from the batch before the next step."""
        try:
            while True:
                item = seq.events.get()
                seq.unread -= 1
                seq.last_read = time.monotonic()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            self.cancel(seq)

    def cancel(self, seq: BatchSequence) -> None:
        seq.cancelled.set()
        with self._cv:
            self._cv.notify_all()

    def close(self) -> None:
        """Stop the worker after its step; every sequence still queued or running gets EngineClosedError."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        closed = EngineClosedError("the engine was closed while this request was being served")
        for seq in [*self._waiting, *self._active]:
            if not seq.done:
                seq.done = True
                seq.put(closed)
        self._waiting.clear()
        self._active.clear()
        self._fail_calls(closed)

    def _fail_calls(self, exc: BaseException) -> None:
        while self._calls:
            _, done = self._calls.popleft()
            if not done.done():
                done.set_exception(exc)

    # ------------------------------------------------------------------ worker
    def _new_cache(self, seq: BatchSequence) -> KVCache | None:
        """``seq``'s KV cache: a range of the slab for its prompt and the first :data:`ANSWER_ROOM` positions of its
        answer, grown as it writes (:meth:`_room_for`); None while no range is free."""
        positions = len(seq.prompt_ids) + seq.out.max_tokens
        c = self.config
        if not (c.kv_budget_bytes and c.kv_bytes_per_token):  # no slab: a cache of its own
            if c.kv_budget_bytes and self._active and (len(self._active) + 1) * c.state_bytes > c.kv_budget_bytes:
                return None  # no layer grows with the length (all sliding windows): the fixed states fill the budget
            cache = self.model.new_cache()
            cache.capacity_hint = positions
            return cache
        assert self._slab is not None  # made with the batcher where there is a KV budget
        slab = self._slab.allocate(min(positions, len(seq.prompt_ids) + ANSWER_ROOM))
        if slab is not None:
            seq.kv_bytes = c.kv_bytes_per_token * slab.capacity + c.state_bytes
        return slab

    def _room_for(self, seq: BatchSequence) -> bool:
        """Whether ``seq``'s cache holds its next segment, growing its slab range when it does not (by
        :data:`GROW_STEP`, or by the segment alone where only that fits; never past what its prompt and answer
        can take)."""
        cache = seq.cache
        rows = seq.rows
        if not isinstance(cache, SlabCache) or cache.length + rows <= cache.capacity:
            return True
        need = len(seq.prompt_ids) + seq.out.max_tokens
        before = cache.capacity
        # a step's worth more where it fits, else just this segment's rows (the slab's last free positions)
        if not any(
            cache.slab.grow(cache, min(need, n)) for n in (cache.length + rows + GROW_STEP, cache.length + rows)
        ):
            return False
        grown = self.config.kv_bytes_per_token * (cache.capacity - before)
        seq.kv_bytes += grown
        self.stats.kv_reserved_bytes += grown
        return True

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # a bug here must not leave readers waiting forever: each gets the error
            with self._cv:
                self._closed = True
                for seq in [*self._waiting, *self._active]:
                    seq.put(exc)
                    self._leave(seq)
                self._waiting.clear()
                self._fail_calls(exc)
            logging.getLogger(__name__).error("the batch worker stopped: %s", exc, exc_info=exc)

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not self._active and not self._waiting and not self._calls:
                    self._cv.wait()
                if self._closed:
                    return
                calls = list(self._calls)
                self._calls.clear()
                self._leave_cancelled()
                self._admit()
                batch = list(self._active)
            for fn, done in calls:
                if done.set_running_or_notify_cancel():
                    try:
                        done.set_result(fn())
                    except BaseException as exc:  # the caller's to handle; the batch goes on
                        done.set_exception(exc)
            if batch:
                self._step(batch)

    def _admit(self) -> None:
        """Waiting requests join in order while the batch has a place and their KV cache fits (under ``_cv``)."""
        c = self.config
        while self._waiting and len(self._active) < c.max_batch and not self._starved:
            seq = self._waiting[0]
            if seq.cancelled.is_set():
                self._waiting.popleft()
                seq.done = True
                continue
            seq.cache = self._new_cache(seq)
            if seq.cache is None:
                break  # its KV cache waits for a sequence to leave (first come, first served)
            self._waiting.popleft()
            seq.start_from(c.prompt_cache)  # only the prompt past its longest kept prefix runs
            if not self._active:  # the batch starts afresh: per-request predictor and cache state start over too
                with self.lock:
                    self.scheduler.new_sequence()
            seq.t_join = time.perf_counter()
            self._active.append(seq)
            self.stats.kv_reserved_bytes += seq.kv_bytes
        self.stats.active, self.stats.waiting = len(self._active), len(self._waiting)
        self.stats.peak_active = max(self.stats.peak_active, self.stats.active)

    def _leave_cancelled(self) -> None:
        """Drop sequences whose reader closed its stream or stopped reading (under ``_cv``)."""
        now = time.monotonic()
        for seq in list(self._active):
            if not seq.cancelled.is_set() and seq.unread > 0 and now - seq.last_read > self.config.idle_timeout:
                seq.put(
                    StreamSupersededError(
                        f"this stream left its tokens unread for {self.config.idle_timeout:.0f} s, so its sequence was "
                        "removed from the batch; read a stream to its end or close() it"
                    )
                )
                seq.cancelled.set()
            if seq.cancelled.is_set():
                self._leave(seq)

    def _leave(self, seq: BatchSequence) -> None:
        if seq in self._active:
            self._active.remove(seq)
            self.stats.kv_reserved_bytes -= seq.kv_bytes
            self._starved = False  # its range is free: a waiting request may fit (else the next step says so)
        seq.done = True
        if isinstance(seq.cache, SlabCache):
            seq.cache.slab.release(seq.cache)
        seq.cache = None  # its KV cache goes with it
        self.stats.active = len(self._active)

    def _step(self, batch: list[BatchSequence]) -> None:
        stepped: list[BatchSequence] = []
        blocked: list[BatchSequence] = []
        prompt_rows = 0
        for seq in batch:
            if seq.chunks and prompt_rows and prompt_rows + seq.rows > self.config.prompt_rows:
                continue  # its chunk waits for the next step
            if not self._room_for(seq):
                blocked.append(seq)  # its range cannot grow now: it waits for room
                continue
            if seq.chunks:
                prompt_rows += seq.rows
            stepped.append(seq)
        self._starved = bool(blocked)
        if not stepped and blocked:  # every sequence waits on another: the one holding most ends here, at its length
            longest = max(blocked, key=lambda q: q.kv_bytes)
            self._finish(longest, longest.out.response("", None, "length"))
            return
        self._run(stepped)

    def _run(self, stepped: list[BatchSequence]) -> None:
        """One forward over ``stepped``. A failed expert read fails only the sequences that need that expert: the
        step is undone (each cache back to its length) and run again one sequence at a time."""
        segments = [seq.segment() for seq in stepped]
        saved = [seq.cache.snapshot() if seq.cache else [] for seq in stepped]  # recurrent states copied too
        with self.lock:
            before = self.scheduler.stats.snapshot()
            try:
                logits = forward_segments(self.model, segments)
                if logits.device.type == "cuda":
                    torch.cuda.synchronize(logits.device)
            except FetchError as exc:
                self.scheduler.abort()
                if len(stepped) == 1:
                    self._fail(stepped, exc)
                    return
                for seq, held in zip(stepped, saved):
                    if seq.cache:
                        seq.cache.restore(held)
                retry = True
            except BaseException as exc:  # out of memory or a bug: the step's sequences fail, nothing stays
                self.scheduler.abort()
                self._fail(stepped, exc)
                return
            else:
                retry = False
                delta = self.scheduler.stats.minus(before)
        if retry:  # outside the lock: each alone takes it again
            for seq in stepped:
                self._run([seq])
            return
        rows = sum(len(s.ids) for s in segments)
        self.stats.steps += 1
        self.stats.rows += rows
        self.stats.sequences_stepped += len(stepped)
        for seq, seg, row in zip(stepped, segments, logits):
            add_stats(seq.stats, share(delta, len(seg.ids) / rows))
            try:
                resp = seq.advance(row)
            except Exception as exc:  # sampling failed for this request alone
                self._finish(seq, exc)
                continue
            if resp is None:  # a prompt chunk before its last
                continue
            self.stats.tokens += 1
            if resp.finish_reason is not None:
                self._finish(seq, resp)
            else:
                seq.put(resp)

    def _finish(self, seq: BatchSequence, last: GenerationResponse | BaseException) -> None:
        if not isinstance(last, BaseException):
            seq.keep_in(self.config.prompt_cache)  # its state, before its range goes back to the slab
        try:
            with self._cv:  # out of the batch before its reader sees the end: the stats it reads next are current
                self._leave(seq)
        finally:  # its reader gets its end even where leaving failed (the worker then stops, failing the others)
            seq.put(last)

    def _fail(self, stepped: list[BatchSequence], exc: BaseException) -> None:
        if isinstance(exc, torch.OutOfMemoryError):
            if self.model.device.type == "cuda":
                torch.cuda.empty_cache()
            exc = DeviceMemoryError(
                f"{self.model.device.type} ran out of memory during a batched step of "
                f"{len(stepped)} sequences; they were stopped and hold nothing: retry, or lower "
                "--max-batch or --memory-budget"
            )
        with self._cv:
            for seq in stepped:
                self._leave(seq)
                seq.put(exc)
