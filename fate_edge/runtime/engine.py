"""``Engine``: a model from an expert store, run under a hard expert-memory budget with a named policy.

    engine = Engine(EngineConfig("stores/tiny-int4", memory_budget="4MB", policy="fate"))
    text, last = engine.generate_text("def main():", GenerateConfig(max_tokens=32))
    print(engine.stats.hit_rate, engine.stats.stall_s)

The budget covers everything expert-sized the engine holds: the cache, the fetch engine's read
buffers (allocated once, so in-flight reads are inside the budget by construction) and the one
decoded expert being computed when it is not cached.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from fate_edge import defaults
from fate_edge.devices.detect import is_jetson_board, read_board_model
from fate_edge.errors import BudgetError, FateEdgeError
from fate_edge.fetch.fetch_engine import BufferPool, FetchEngine
from fate_edge.fetch.transfer import make_copier
from fate_edge.format.checkpoint_layout import DTYPES
from fate_edge.format.store import ExpertStore, is_store
from fate_edge.model.experts import ExpertProvider
from fate_edge.runtime.auto_budget import (
    BudgetChoice,
    choose_budget,
    experts_cap,
    free_memory,
    is_auto,
    memory_sources,
)
from fate_edge.runtime.auto_threads import set_load_threads, settle_threads
from fate_edge.runtime.batch import BatchConfig, Batcher, default_max_batch
from fate_edge.runtime.budget import BudgetPlan, memory_shortfall, parse_bytes, plan_budget
from fate_edge.runtime.cache import ExpertCache
from fate_edge.runtime.cache.factory import Resident, build_cache, layer_slots, pick_resident
from fate_edge.runtime.compute_dtype import resolve_dtype
from fate_edge.runtime.engine_config import EngineConfig, PolicyChoice, Trace, plan_policy, resolve_device
from fate_edge.runtime.exit_close import shut_down, shut_down_with
from fate_edge.runtime.generate import PREFILL_CHUNK, GenerateConfig, GenerationResponse, stream_from_model
from fate_edge.runtime.held_bytes import entry_bytes
from fate_edge.runtime.host_tier import open_host_tier, tier_held
from fate_edge.runtime.load_threads import in_own_thread
from fate_edge.runtime.loader import load_model
from fate_edge.runtime.memory_account import available_memory_bytes, kv_shape, memory_account, shortfall
from fate_edge.runtime.memory_tiers import is_unified, plan_tiers, staging_held
from fate_edge.runtime.policy import PolicyConfig, for_model, get_policy
from fate_edge.runtime.preload import LoadReport, first_used, global_choice, preload, preload_choice, read_whole_model
from fate_edge.runtime.prompt_cache import PromptCache
from fate_edge.runtime.prompt_heap import Claim, serve_from_heap
from fate_edge.runtime.request_slot import RequestSlot
from fate_edge.runtime.scheduler import Scheduler, SchedulerStats, hands_off
from fate_edge.runtime.warm_up import warm_up
from fate_edge.sizes import format_bytes
from fate_edge.tokenizer import Tokenizer

_log = logging.getLogger(__name__)


@dataclass
class Completion:
    """A finished request."""

    text: str
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int
    prompt_tps: float
    generation_tps: float
    peak_rss_bytes: int
    stats: SchedulerStats  # expert cache and fetch statistics of this request


class _TraceRecorder:
    def __init__(self, trace: Trace):
        self.trace = trace

    def __call__(self, layer: int, h: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> None:
        ids, counts = idx.flatten().unique(return_counts=True)
        self.trace.calls.append((layer, ids[counts.argsort(descending=True, stable=True)].tolist()))


def streamed_by_store(policy: PolicyConfig, store: ExpertStore) -> PolicyConfig:
    """A preset's int4 reads on a store that holds int8 and no int4 (a q8_0 GGUF converts to its own int8 codes):
    int8, the store's quantized copy. A preset named for int4 (load-on-demand-int4) keeps asking for int4."""
    if policy.bits == 4 and "int4" not in policy.name and 4 not in store.precisions and 8 in store.precisions:
        return policy.with_(bits=8)
    return policy


class Engine:
    def __init__(self, config: EngineConfig):
        """Open ``config.store_dir`` under ``config.memory_budget``; a policy of "auto" is the planner's to resolve
        first (:meth:`load` does)."""
        if config.policy == "auto":
            raise FateEdgeError("policy 'auto' is chosen by the planner: open the engine with Engine.load(...)")
        c = self.config = config
        device = self.device = resolve_device(c.device)
        self.context_tokens = c.context_tokens  # the KV room the account reserves: an unbounded request stops there
        # Model, scheduler and cache are shared: one step at a time (_lock); the stream to step next: _slot (stream())
        self._lock = threading.Lock()
        self._slot = RequestSlot()
        self.stream_idle_timeout = 30.0  # seconds an open, unread stream holds the engine against a new request
        if not is_store(c.store_dir):
            raise FateEdgeError(f"{c.store_dir}: not an expert store; create one with `fate-edge convert MODEL OUT`")
        self.planned: PolicyChoice | None = None  # the planner's choice, where Engine.load asked it
        self.policy = get_policy(c.policy)
        dtype = resolve_dtype(c.dtype, device, c.store_dir)  # "auto": the hardware's native dtype (compute_dtype)
        self.dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        self.store = ExpertStore(c.store_dir)
        if isinstance(c.policy, str):
            self.policy = streamed_by_store(self.policy, self.store)
        for bits in {self.policy.bits} | ({self.policy.cold_bits} - {None}):
            if bits not in self.store.precisions and bits != self.policy.cold_bits:
                fix = "--keep-bf16" if bits == 16 else f"--bits {bits}"
                raise FateEdgeError(
                    f"policy '{self.policy.name}' needs {'bf16' if bits == 16 else f'int{bits}'} experts but "
                    f"{c.store_dir} holds {self.store.bits_available}; re-run fate-edge convert with {fix}"
                )
        # "auto": chosen at load from the memory account and this machine's free memory (auto_budget)
        self._auto_budget = is_auto(c.memory_budget)
        self.budget = 0 if self._auto_budget else parse_bytes(c.memory_budget)
        self.budget_choice: BudgetChoice | None = None
        # A batched engine computes on its batcher thread: it loads, and makes its batcher (whose KV slab is zeroed
        # by a parallel fill), on a thread of its own, whose OpenMP helper threads end with it, so that the
        # batcher's team is the process's only one (runtime.load_threads; docs/measured-choices.md)
        batched = (c.max_batch or default_max_batch(device)) > 1 and c.trace is None and device == "cpu"
        if batched:
            in_own_thread(self._open)
        else:
            self._open()
        heap = self._heap = Claim()  # a prompt's temporaries from the heap where no expert is copied (prompt_heap)
        serve_from_heap(heap, self.scheduler.zero_copy or self.scheduler.lends, self.store)
        # no thread of this engine left computing once it is closed, dropped or the interpreter exits (exit_close)
        parts = (self.batcher, self._slot, self._lock, self.scheduler, self.cache, self.fetch, self.host_tier, heap)
        self._shut = shut_down_with(self, functools.partial(shut_down, *parts))

    def _open(self) -> None:
        """Load the model and build the fetch engine, cache, scheduler and batcher under the budget."""
        c, device = self.config, self.device
        args = (c.store_dir, self.budget, self.dtype, c.context_tokens, c.resident_bits, None, c.embedding_bits)
        self.account = memory_account(*args, prompt_cache=c.prompt_cache)
        if self._auto_budget:
            self.budget_choice = choose_budget(
                self.account, experts_cap(c.store_dir, self.policy.bits), free_memory(memory_sources(self.device))
            )
            self.budget = self.budget_choice.budget
            self.account = replace(self.account, expert_budget=self.budget)
            _log.info(self.budget_choice.line())
        self._check_account()
        self.model = load_model(
            c.store_dir,
            dtype=self.dtype,
            experts=_NoExperts(),
            device=device,
            resident_bits=c.resident_bits,
            embedding_bits=c.embedding_bits,
        )
        self.policy = for_model(self.policy, self.model.config.model_type)  # e.g. Fate's tail share per model
        self.tokenizer = Tokenizer(c.store_dir)
        self.link = c.link
        if self.policy.predictor == "oracle" and c.trace is None:
            raise FateEdgeError("the oracle policy needs a recorded trace of the same request (Engine.record_trace)")
        self.trace = c.trace
        self.plan = self._plan_budget(c.max_inflight_prefetches)
        self.host_tier = open_host_tier(c.host_memory, self)  # between the store and a discrete GPU's cache
        self.account = replace(self.account, tiers=plan_tiers(self.plan, self._unified, tier_held(self.host_tier)))
        bits_used = [b for b in (self.policy.bits, self.policy.cold_bits) if b in self.store.precisions]
        slot = max(self.store.precisions[b].slot_bytes for b in bits_used)
        # On a GPU, staging buffers are pinned so copies to the device are asynchronous DMA.
        pool = BufferPool(self.plan.pool_buffers, slot, pinned=device.startswith("cuda"))
        self.fetch = FetchEngine(
            pool,
            workers=c.workers,
            link=c.link,
            direct_io=c.direct_io,
            verify=c.verify,
            demand_reserve=self.plan.demand_buffers,
        )
        self._check_memory()
        self.cache = self._make_cache()
        self.scheduler = Scheduler(
            self.model.config,
            self.store,
            self.fetch,
            self.cache,
            self.policy,
            self._make_predictor(),
            self.dtype,
            device,
            max_inflight_prefetches=self.plan.pool_buffers - 2,
            host_tier=self.host_tier,
        )
        self.model.experts = self.scheduler
        # A replayed trace follows the recorded run call by call, and the recording saw every token in every layer.
        self.scheduler.needs_every_token = c.trace is not None
        self.model.observers.append(self.scheduler)
        self.load_report = self._preload()  # reads at load: apart from every request's statistics
        # zero-copy: the cache's memory faulted in now, not one read at a time mid-token
        if self.scheduler.zero_copy and self.cache is not None:
            uncached = len(self.model.config.moe_layers) * self.model.config.num_experts - len(self.cache.entries)
            pool.add_spares(min(self.cache.free_entries(pool.size), uncached))
        # a budget that holds the model: read it all now, as llama.cpp loads one (a replayed trace reads as recorded)
        if self.scheduler.all_at_hand and c.trace is None:
            cfg = self.model.config
            read_whole_model(self.scheduler, cfg.moe_layers, cfg.num_experts, self.load_report)
            self.scheduler.forget_stats()  # the load report's, not a request's
        room = self.account.prompt_cache  # the account's part: the cache holds no more
        self.prompt_cache = PromptCache(room, self.model.config.num_hidden_layers) if room else None
        self.token_stats: list[SchedulerStats] = []  # per generated token of the last request
        self.prefill_stats = SchedulerStats()
        self._request_stats = SchedulerStats()
        self._local = threading.local()  # a batched stream's own statistics, per reading thread
        self.batcher = self._make_batcher(c.max_batch, c.context_tokens)

    def _make_batcher(self, max_batch: int, context_tokens: int) -> Batcher | None:
        """Continuous batching for ``max_batch`` > 1 (0: :func:`default_max_batch`). Not for a replayed trace
        (the oracle follows one request's recorded calls)."""
        if max_batch < 0:
            raise FateEdgeError(f"max_batch must be >= 0 (0: the machine's default), got {max_batch}")
        max_batch = max_batch or default_max_batch(self.device)
        if max_batch == 1 or self.trace is not None:
            return None
        per_token, fixed = kv_shape(self.model.config, self.dtype, self.account.context_tokens)
        kv = (self.account.kv_cache, per_token, PREFILL_CHUNK, self.stream_idle_timeout, self.prompt_cache)
        config = BatchConfig(max_batch, *kv)
        config.state_bytes = fixed  # each sequence's recurrent states and sliding windows' rings, if any
        return Batcher(self.model, self.tokenizer, self.scheduler, self._lock, config)

    @property
    def max_batch(self) -> int:
        """Sequences one step may carry (1: requests are served one at a time)."""
        return self.batcher.config.max_batch if self.batcher is not None else 1

    @property
    def request_stats(self) -> SchedulerStats:
        """The statistics of the request being read on this thread (a batched stream's share of its steps), else
        of the last request served alone."""
        own = getattr(self._local, "stats", None)
        return own if own is not None else self._request_stats

    @request_stats.setter
    def request_stats(self, stats: SchedulerStats) -> None:
        self._request_stats = stats

    def _check_account(self) -> None:
        """Refuse before anything loads when the run's peak (memory_account) cannot fit the free memory. On a
        discrete GPU the weights and the cache live in its memory: ``_check_memory`` judges that after load."""
        if self.device.startswith("cuda") and not is_jetson_board(read_board_model()):
            return
        why = shortfall(self.account, available_memory_bytes())
        if why:
            raise BudgetError(f"memory budget {format_bytes(self.budget)}: {why}")

    def _check_memory(self) -> None:
        """The budget is a promise: refuse at once one this machine cannot hold, rather than fail mid-answer."""
        import psutil

        cfg = self.model.config
        experts = len(cfg.moe_layers) * cfg.num_experts * self.plan.entry_bytes  # the cache never holds more
        if self.resident is not None:  # ... but for a layer held in another precision
            experts += self.resident.nbytes - cfg.num_experts * self.plan.entry_bytes
        device_need = min(self.plan.cache_bytes, experts) + self.plan.working_bytes
        device_free, unified = None, True
        if self.device.startswith("cuda"):
            device_free = torch.cuda.mem_get_info(torch.device(self.device))[0]
            unified = is_jetson_board(read_board_model())  # integrated GPU: one DRAM for CPU and GPU
        host_need = self.plan.host_bytes if self.plan.staging_on_host else self.plan.pool_bytes
        why = memory_shortfall(host_need, device_need, int(psutil.virtual_memory().available), device_free, unified)
        if why:
            raise BudgetError(f"memory budget {format_bytes(self.budget)}: {why}")

    @property
    def _unified(self) -> bool:  # one memory for the experts, or a device and a host budget (runtime.memory_tiers)
        return is_unified(self.device)

    def _entry_bytes(self, bits: int) -> int:
        return entry_bytes(self.store, self.model.config.moe_layers[0], bits, self.dtype, self.device)

    def _plan_budget(self, max_inflight: int) -> BudgetPlan:
        p, cfg = self.policy, self.model.config
        bits_used = [b for b in (p.bits, p.cold_bits) if b in self.store.precisions]
        slot = max(self.store.precisions[b].slot_bytes for b in bits_used)
        entry = self._entry_bytes(p.bits)
        if hands_off(p, self.store, self.device):  # a cached expert keeps its whole read buffer
            entry = max(entry, slot)
        # a discrete GPU's staging is pinned host memory, outside its device budget (runtime.memory_tiers)
        held = 0 if self._unified else staging_held(slot, pinned=True)
        plan = plan_budget(self.budget, p, entry, slot, max_inflight, top_k=cfg.num_experts_per_tok, staging_held=held)
        self.resident = self._resident(plan.cache_bytes)
        left = plan.cache_bytes - (self.resident.nbytes if self.resident else 0)
        plan.slots = layer_slots(
            p, left // plan.entry_bytes, cfg.moe_layers, cfg.num_experts, self.popularity, self.resident
        )
        return plan

    def _resident(self, cache_bytes: int) -> Resident | None:
        """Fate's first MoE layer held whole: in full precision if the cache can hold it, else int{bits}."""
        p, cfg = self.policy, self.model.config
        if not (p.resident_first and p.cache and p.allocation != "global"):
            return None
        sizes = {b: self._entry_bytes(b) for b in (16, p.bits) if b in self.store.precisions}
        return pick_resident(cfg.moe_layers[0], cfg.num_experts, cache_bytes, sizes)

    def _preload(self) -> LoadReport:
        """Load the resident layer, and fill the cache when the policy asks (Fate)."""
        p, cfg, r = self.policy, self.model.config, self.resident
        report = LoadReport(r.layer if r else None, r.bits if r else None, r.note if r else "")
        if p.resident_first and r is None:
            report.note = (
                f"the cache ({format_bytes(self.plan.cache_bytes)}) cannot hold layer {cfg.moe_layers[0]} "
                f"whole even as int{p.bits}: it is cached like the others"
            )
        if self.cache is None or not (p.preload or r):
            return report
        if p.predictor == "oracle" and self.trace is not None:
            choice = first_used(self.trace.calls, self.cache.capacity_bytes // self.cache.entry_bytes)
        elif p.preload and p.allocation == "global":  # one partition: the most used experts across layers
            choice = global_choice(
                self.cache.capacity_bytes // self.cache.entry_bytes, cfg.moe_layers, cfg.num_experts, self.popularity
            )
        else:
            slots = self.plan.slots if p.preload or r is None else {r.layer: cfg.num_experts}
            choice = preload_choice(slots, cfg.num_experts, self.popularity)
        # Its own copier: the scheduler's counts uploads per token, and these belong to none.
        return preload(self.cache, self.store, choice, p.bits, r, self.dtype, make_copier(self.device), report)

    @property
    def popularity(self) -> dict[int, list[int]] | None:
        """Calibration expert counts per layer (``fate-edge calibrate``), if the store carries them."""
        from fate_edge.format.popularity import store_popularity

        return store_popularity(self.store.path)

    def _make_cache(self) -> ExpertCache | None:
        cfg = self.model.config
        future = self.trace.calls if self.trace else None  # Belady follows the recorded run call by call
        return build_cache(
            self.policy,
            self.plan.cache_bytes,
            self.plan.entry_bytes,
            cfg.moe_layers,
            cfg.num_experts,
            future,
            self.popularity,
            self.resident,
            cfg.num_experts_per_tok,
        )

    def _make_predictor(self):
        name = self.policy.predictor
        if name is None:
            return None
        if name == "best-available":  # learned if the model was calibrated, else the norm-aware gate
            try:
                return self._predictor("learned")
            except FateEdgeError:
                return self._predictor("cross-layer-norm")
        return self._predictor(name)

    def _predictor(self, name: str):
        p, model, cfg = self.policy, self.model, self.model.config
        found = self.store.path / "predictors"
        if name in ("cross-layer", "cross-layer-norm"):
            from fate_edge.predictors.cross_layer_gate import CrossLayerGate

            return CrossLayerGate.from_model(model, lookahead=p.lookahead, norm_variant=name.endswith("norm"))
        if name in ("learned", "learned-onnx"):
            from fate_edge.predictors.learned import LearnedPredictor, OnnxPredictor, find_learned

            path = find_learned(found, p.lookahead)
            if path is not None:
                learned = (
                    OnnxPredictor(path, lookahead=p.lookahead)
                    if name == "learned-onnx"
                    else LearnedPredictor.load(path, lookahead=p.lookahead)
                )
                learned.attach(model)  # calibrate --early-attention: it reads the model's residual and KV cache
                return learned
            raise FateEdgeError(
                f"policy '{p.name}' uses learned predictors but {found} has none with lookahead >= {p.lookahead}; "
                f"run `fate-edge calibrate MODEL --lookahead {p.lookahead}`, then use the model again"
            )
        if name == "activation-path":
            from fate_edge.predictors.activation_path import ActivationPathPredictor

            return ActivationPathPredictor(
                cfg.moe_layers, cfg.num_experts, lookahead=p.lookahead, popularity=self.popularity
            )
        if name == "oracle":
            from fate_edge.predictors.oracle import OraclePredictor

            assert self.trace is not None  # the oracle replays a recorded trace
            return OraclePredictor(self.trace.calls, cfg.moe_layers, lookahead=p.lookahead, num_experts=cfg.num_experts)
        raise FateEdgeError(f"unknown predictor '{name}'")

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        memory_budget: int | str = defaults.MEMORY_BUDGET,
        policy: str | PolicyConfig = defaults.POLICY,
        device: str = defaults.DEVICE,
        dtype: str | torch.dtype = defaults.DTYPE,
        threads: int | str | None = defaults.THREADS,
        **kw: Any,
    ) -> Engine:
        """Open a model directory or expert store (default: the bundled model), converting it to a store once.
        Keywords: the fields of :class:`EngineConfig`. Concurrent requests are batched (``max_batch``: 0, the
        machine's default, unless given). ``policy="auto"``: the planner picks the policy for this host, budget
        and link first (its choice, prediction included, is ``engine.planned``; ``plan_sample``: a prompt like the
        ones to serve, which it probes instead of its own text). ``threads``: torch's CPU threads for the process,
        as the CLI sets them (default "auto": the cores this process may use less the fetch workers while experts
        stream, every core once a real model its budget holds is loaded, ``runtime.auto_threads``; torch's own
        default takes every core, so a streaming engine's fetch worker made a third thread on a 2-core host and
        decode ran at about half speed: docs/measured-choices.md); None leaves torch's setting as it is."""
        from fate_edge.bundled import bundled_model_dir
        from fate_edge.format.converted_stores import ensure_store

        set_load_threads(threads)
        kw.setdefault("max_batch", 0)  # the SDK's engine batches concurrent requests (the machine's default size)
        # a first use converts here: on a thread of its own too where the batcher will compute (runtime.load_threads)
        convert = lambda: ensure_store(path or bundled_model_dir(), progress=False)  # noqa: E731
        batched = kw["max_batch"] != 1 and resolve_device(device) == "cpu"
        store = in_own_thread(convert) if batched else convert()
        config = EngineConfig(store, memory_budget, policy, dtype=dtype, device=device, **kw)
        planned = None
        if config.policy == "auto":  # the planner's probes run on a thread of their own too
            from fate_edge.runtime.auto_budget import resolve_budget

            dev = resolve_device(config.device)
            dt = resolve_dtype(config.dtype, dev, store)
            # "auto" chosen once here, so the planner and the engine plan for the same budget and dtype
            c = config
            b = resolve_budget(
                store, c.memory_budget, dt, c.context_tokens, c.resident_bits, c.embedding_bits, dev, 4, c.prompt_cache
            )
            config = replace(config, dtype=dt, memory_budget=b)
            planned = in_own_thread(lambda: plan_policy(config))
            config = replace(config, policy=planned.policy)
        engine = cls(config)
        engine.scheduler.seed_misses(planned)  # the planner's measured miss costs start the hybrid rule
        engine.planned = planned
        settle_threads(threads, not engine.scheduler.all_at_hand, engine.model.config.hidden_size, engine.device)
        warm_up(engine.batcher, engine.scheduler, engine.model, engine._lock)  # with the requests' threads
        return engine

    def stream(
        self, prompt: str | list[int], config: GenerateConfig | None = None
    ) -> Generator[GenerationResponse, None, None]:
        """Yield one response per generated token. With ``max_batch`` > 1, streams from any thread are served
        together (runtime.batch), each with its own KV cache, sampling and stops; closing one removes only its
        sequence. Bad input raises before the first token."""
        config = config or GenerateConfig()
        if config.max_tokens is None and config.context_limit is None:  # until end of text or this engine's room
            config = replace(config, context_limit=self.context_tokens)
        if self.batcher is None:
            return self._stream_alone(prompt, config)
        seq = self.batcher.submit(prompt, config)
        return self._batched(seq)

    def _batched(self, seq) -> Generator[GenerationResponse, None, None]:
        batcher = self.batcher
        assert batcher is not None
        try:
            for step in batcher.responses(seq):
                self._local.stats = seq.stats.snapshot()
                yield step
        finally:
            batcher.cancel(seq)

    def _stream_alone(
        self, prompt: str | list[int], config: GenerateConfig | None = None
    ) -> Generator[GenerationResponse, None, None]:
        """Yield one response per generated token. Requests (from any thread) are served one at a time.

        The engine is held while a step runs, never across a ``yield``: a new request waits for an open
        stream that keeps being read, but one left idle (neither advanced nor closed) for
        ``stream_idle_timeout`` seconds is superseded, and its next step raises StreamSupersededError. So a
        generator kept alive but abandoned cannot block a server. Close a stream you stop reading
        (``.close()``) to free the engine at once; a step that fails leaves nothing in flight."""
        ticket = self._slot.claim(self.stream_idle_timeout)
        try:
            with self._step(ticket):
                self.scheduler.new_sequence()
                self.token_stats = []
                start = before = self.scheduler.stats.snapshot()
                steps = stream_from_model(self.model, self.tokenizer, prompt, config, self.prompt_cache)
            for i in itertools.count():
                with self._step(ticket):
                    step = next(steps, None)
                    if step is None:
                        return
                    now = self.scheduler.stats.snapshot()
                    if i == 0:
                        self.prefill_stats = now.minus(before)  # prefill plus the first sampled token
                    else:
                        self.token_stats.append(now.minus(before))
                    before = now
                    self.request_stats = now.minus(start)
                yield step
        except BaseException:  # failed (a read error) or closed early: leave nothing in flight
            with self._lock:
                if self._slot.owns(ticket):  # a superseded stream's state already belongs to the new request
                    self.scheduler.abort()
            raise
        finally:
            self._slot.release(ticket)

    @contextmanager
    def _step(self, ticket: int) -> Iterator[None]:
        """Run one step of the stream holding ``ticket``, alone on the engine."""
        with self._lock:
            self._slot.begin(ticket)
            try:
                yield
            finally:
                self._slot.end(ticket)

    def generate_text(
        self, prompt: str | list[int], config: GenerateConfig | None = None
    ) -> tuple[str, GenerationResponse]:
        parts, last = [], None
        for last in self.stream(prompt, config):
            parts.append(last.text)
        assert last is not None
        return "".join(parts), last

    def complete(self, prompt: str | list[int], config: GenerateConfig | None = None) -> Completion:
        """Generate and return a typed :class:`Completion`."""
        parts, last, stats = [], None, None
        for last in self.stream(prompt, config):
            parts.append(last.text)
            stats = self.request_stats  # read while this request still holds the lock
        assert last is not None and stats is not None
        return Completion(
            "".join(parts),
            last.finish_reason or "length",
            last.prompt_tokens,
            last.generation_tokens,
            last.prompt_tps,
            last.generation_tps,
            last.peak_rss_bytes,
            stats,
        )

    def chat(self, messages: list[dict], config: GenerateConfig | None = None) -> Completion:
        """Render ``messages`` with the model's chat template and complete the assistant turn."""
        return self.complete(self.tokenizer.apply_chat_template(messages), config)

    def record_trace(self, prompt: str | list[int], config: GenerateConfig | None = None) -> Trace:
        """Run the request once and record every layer's experts, for the oracle policy."""
        trace = Trace()
        recorder = _TraceRecorder(trace)
        self.model.observers.insert(0, recorder)
        try:
            for _ in self._stream_alone(prompt, config):  # alone: a batch would record the others' experts too
                pass
        finally:
            self.model.observers.remove(recorder)
        return trace

    @property
    def stats(self) -> SchedulerStats:
        return self.scheduler.stats

    def abort(self) -> None:
        """Return the engine to a clean state (nothing in flight, nothing pinned); waits for a running request."""
        with self._lock:
            self.scheduler.abort()

    def close(self) -> None:
        """Stop the fetch workers and free the cached experts (an engine is not usable after this).
        Waits for a step in progress; an open stream's next step then raises EngineClosedError."""
        self._shut()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _NoExperts(ExpertProvider):
    """Placeholder provider while the engine wires the scheduler in."""

    def get(self, layer: int, expert: int):
        raise FateEdgeError("engine not initialised")
