"""The prefetch scheduler: joins predictor, expert cache and fetch engine behind the ExpertProvider API.

Per MoE layer i (docs/architecture.md §1): the model's router runs and calls :meth:`Scheduler.on_route` with the
gate input and the chosen experts. The scheduler then (1) issues demand fetches for this layer's
misses, most popular first; (2) asks the predictor for layers i+1..i+p and queues prefetches, nearest
layer and most probable first, skipping what is cached or in flight; then the MoE block pulls experts
through :meth:`Scheduler.stream`, which yields cached ones at once and the rest as they arrive, and
:meth:`Scheduler.end_layer` unpins them and drops prefetches that turned out unused.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator

import torch

from fate_edge.devices.detect import reader_contention
from fate_edge.fetch.buffer_pool import Buffer
from fate_edge.fetch.fetch_engine import FetchEngine, FetchRequest, Priority
from fate_edge.fetch.transfer import Copier, CPUCopier, make_copier
from fate_edge.format.store import ExpertStore, decode_expert
from fate_edge.model.arch.base import ModelConfig
from fate_edge.model.experts import Expert, ExpertProvider, into_rows_of_four
from fate_edge.predictors.base import Predictor
from fate_edge.runtime.buffer_handoff import hands_off, lends
from fate_edge.runtime.cache import AccessInfo, ExpertCache
from fate_edge.runtime.host_tier import HostTier
from fate_edge.runtime.layer_blobs import Fetch, LayerBlobs
from fate_edge.runtime.policy import PolicyConfig
from fate_edge.runtime.prefetch_gate import PrefetchGate
from fate_edge.runtime.read_ahead import ReadAhead
from fate_edge.runtime.resident_layers import ResidentLayers
from fate_edge.runtime.scheduler_stats import SchedulerStats
from fate_edge.runtime.tier_path import TierPath

Key = tuple[int, int]


def _ema(old: float, new: float, keep: float) -> float:
    """Exponential moving average that starts at the first sample (0 means none yet)."""
    return new if old == 0 else keep * old + (1 - keep) * new


class Scheduler(TierPath, LayerBlobs, ResidentLayers, ReadAhead, ExpertProvider):
    # Serving needs no routing of prompt tokens whose outputs nothing reads (see model.decoding_model.RoutingObserver).
    needs_every_token = False

    def __init__(
        self,
        config: ModelConfig,
        store: ExpertStore,
        fetch: FetchEngine,
        cache: ExpertCache | None,
        policy: PolicyConfig,
        predictor: Predictor | None = None,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        max_inflight_prefetches: int = 8,
        copier: Copier | None = None,
        host_tier: HostTier | None = None,
        upload_on_land: bool | None = None,
    ):
        self.config = config
        self.store = store
        self.fetch = fetch
        self.cache = cache
        self.policy = policy
        self.predictor = predictor
        self.dtype = dtype
        self.copier = copier or make_copier(device)
        self.host = host_tier  # blobs in host memory between the store and the device cache (runtime.host_tier)
        self.zero_copy = (
            cache is not None
            and host_tier is None
            and isinstance(self.copier, CPUCopier)
            and hands_off(policy, store, self.copier.device.type)
        )
        self._kept: dict[Key, Buffer] = {}  # read buffers that hold cached experts (zero-copy)
        self.lends = (
            cache is None
            and host_tier is None
            and isinstance(self.copier, CPUCopier)
            and lends(policy, store, self.copier.device.type)
        )
        # Prefetched experts made ready (uploaded, decoded, cached) as their reads land, not when their layer asks: on
        # a GPU (the copy overlaps compute); a CPU's zero-copy hand-off has nothing to upload
        on_land = self.copier.device.type != "cpu" if upload_on_land is None else upload_on_land
        self.land_early = on_land and cache is not None and not self.zero_copy
        self.stages_prompts = False  # a prompt's reads are staged as blobs (runtime.staged_prefill): none land early
        self._landed: dict[Key, int] = {}  # made ready early → bytes read, until its layer uses it
        self._host_held: list[Key] = []  # host-tier blobs this layer's misses come from: pinned there till end_layer
        self._on_cpu = policy.miss_compute == "hybrid" and host_tier is not None  # misses computed in place
        self.miss_rule, self._rows = self._new_miss_rule(), {}  # where each of those runs (runtime.miss_rule)
        self._lent: list[FetchRequest] = []  # buffers of experts served by get(): released at end_layer
        self._hold_lent = False
        self.lent_reads = 0  # experts computed in their read buffer and not kept (the rest: copied out or handed off)
        self._evicted: list[Buffer] = []  # ... of experts the cache let go: the pool's next buffer, once unused
        if self.zero_copy and cache is not None:
            cache.on_evict = lambda key: self._evicted.append(self._kept.pop(key)) if key in self._kept else None
        self.max_inflight = max_inflight_prefetches
        self.cold_bits = policy.cold_bits if policy.cold_bits in store.precisions else None
        self.stats = SchedulerStats()
        self.layer_index = {layer: i for i, layer in enumerate(config.moe_layers)}
        self._experts = len(config.moe_layers) * config.num_experts
        self._holds_model = self._cache_holds_model()  # nothing is ever evicted (all_at_hand)
        self._holds_at = cache.resized if cache is not None else 0  # the cache's size it was decided for
        self.prefetches: dict[Key, Fetch] = {}
        # Planned reads ahead waiting for room (at most max_inflight are submitted): the layer being computed
        # still holds its own prefetches when it predicts, and frees their room as it consumes them.
        self.deferred: dict[Key, tuple[int, Priority]] = {}
        self._dropping: list[tuple[Fetch, bool]] = []  # cancelled reads still stopping (see _drop)
        self.demands: dict[Key, Fetch] = {}
        self.skip: set[Key] = set()
        self.in_use: list[Key] = []
        self.layer_uses: dict[int, list[int]] = {}  # MoE layer → [cached, prefetched, demand] expert uses
        self.last_prediction: dict[int, list[int]] = {}
        self._candidates: dict[int, dict[int, int]] = {}  # target → rank → expert not cached when predicted
        self._layer_time = 0.0  # EMA of one decoder layer's compute time (decode)
        self._read_bw = 0.0  # EMA of measured read bandwidth, bytes/s
        self._read_cpu = 0.0  # EMA of a read's reader-thread CPU seconds
        self._last_route: tuple[int, float] | None = None
        self._prefill = False  # the layer call being served is part of a prompt
        self._prompt = False  # the forward pass under way is a prompt's (begin_forward)
        self._sequences = 1  # sequences in the forward pass under way: a batched decode step routes one row each
        # Prefetch gate (fate-edge): per prediction rank, evidence of whether a read would pay.
        self.gate = PrefetchGate(max(policy.max_prefetch_width, config.num_experts_per_tok))
        # The gate weighs a read's reader CPU against the compute it delays: on a GPU the compute is not the CPU's
        self._gate = policy.prefetch_gate and self.copier.device.type == "cpu"
        self._contention = reader_contention(torch.get_num_threads(), fetch.workers)
        self._predict_cost = 0.0  # EMA of one layer call's predictor + prefetch planning seconds
        self._reads: int | None = None  # the reads a layer call may issue where the gate decided its ranks

    # ------------------------------------------------------------- routing hook
    def begin_forward(self, tokens: int, sequences: int = 1) -> None:
        self._prompt = tokens > 1
        self._sequences = sequences

    def on_route(self, layer: int, h: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> None:
        now = time.perf_counter()
        n = h.shape[0]
        # A prompt's last layer may route its last token alone (model.forward): still served as the prompt. A
        # batched decode step routes one row per sequence: decode, with the batch's union of experts.
        self._prefill = prompt = n > self._sequences or self._prompt
        if n == 1 and self._all_cached():  # a row of a model cached whole: nothing to read, predict or check
            self.observe_routing(layer, idx[0].tolist(), [1] * idx.shape[1], prompt)
            self.last_prediction.pop(layer, None)  # one made before the last expert was cached checks nothing now
            self._candidates.pop(layer, None)
            self.stats.predictions_skipped += int(self.predictor is not None)
            return
        if not prompt and self._last_route is not None and self._last_route[0] < layer:
            dt = (now - self._last_route[1]) / max(1, self.layer_index[layer] - self.layer_index[self._last_route[0]])
            self._layer_time = _ema(self._layer_time, dt, 0.8)
        self._last_route = (layer, now)
        self._land()

        if n == 1:  # one row's top-k: distinct, one use each, so the order below is by id (no torch ops a layer)
            needed = sorted(idx[0].tolist())
            uses = [1] * len(needed)
        else:
            ids, counts = idx.flatten().unique(return_counts=True)
            order = counts.argsort(descending=True, stable=True)
            needed, uses = ids[order].tolist(), counts[order].tolist()
        self.observe_routing(layer, needed, uses, prompt)
        self._check_prediction(layer, idx, prompt)

        # Prefill demand reads travel in the policy's precision: only predicted, prefetched experts may be cold
        # (Fate reads a miss in int4; its int2 tail is the prefetch plan's, prefetch_choice.choose).
        low = set() if prompt or n > 1 else self._precision_on_miss(layer, idx, weights)
        for e in needed:
            key = (layer, e)
            if (self.cache is not None and key in self.cache) or key in self.prefetches or key in self.skip:
                if key in self.prefetches:  # needed now: promote the prefetch to demand priority
                    self.fetch.promote(self.prefetches[key].req, Priority.DEMAND)
                continue
            bits = self.cold_bits if (e in low and self.cold_bits) else self.policy.bits
            if bits == self.policy.bits and self._host_holds(key):
                continue
            req = self._submit(key, bits, Priority.DEMAND)
            self.demands[key] = Fetch(req, bits, prefetched=False)

        if self.predictor is not None and self._all_cached():
            # nothing a prediction could name is left to read, nor will be (a cache that holds the model evicts none)
            self.stats.predictions_skipped += 1
        elif self.predictor is not None:
            t0 = time.perf_counter()
            self.predictor.observe(layer, needed)
            width = self._width()
            if self._targets_full(layer):
                self.stats.predictions_skipped += 1
            elif self._should_predict(prompt, width):
                self._prefetch(layer, h, width)
                if not prompt:
                    dt = time.perf_counter() - t0
                    self._predict_cost = _ema(self._predict_cost, dt, 0.9)
            self.predictor.observe_input(layer, h)  # after predicting: the next token reads it as the previous one
            self.stats.predict_s += time.perf_counter() - t0

    __call__ = on_route  # usable directly as a model routing observer

    @property
    def all_at_hand(self) -> bool:  # type: ignore[override]
        """A cache that holds every expert of the model (a budget that fits it): each one is read once, at its first
        use, and from then on a layer's experts come in one group with nothing to wait for, so the MoE block computes
        the shared expert in their kernel calls (before the first group of a warming layer, had it no hits). Decided
        again after the cache shrinks (staged prefill takes its room)."""
        if self.cache is not None and self.cache.resized != self._holds_at:
            self._holds_model, self._holds_at = self._cache_holds_model(), self.cache.resized
        return self._holds_model

    def _all_cached(self) -> bool:
        """Every expert of the model in the cache now (a cache that :attr:`all_at_hand` holds them, once read)."""
        cache = self.cache
        return cache is not None and len(cache.entries) == self._experts and self.all_at_hand

    def _cache_holds_model(self) -> bool:
        layers, n = self.config.moe_layers, self.config.num_experts
        return self.cache is not None and self.cache.holds_all((layer, e) for layer in layers for e in range(n))

    def _precision_on_miss(self, layer: int, idx: torch.Tensor, weights: torch.Tensor) -> set[int]:
        """HOBBIT/MoE-APEX: order the token's experts by normalised gate weight; s(e_i) = Σ_{j<i} w_j.
        A miss with s > T1 loads the cold precision; s > T2 is skipped only if the policy opts in."""
        if not self.policy.precision_on_miss or self.cold_bits is None:
            return set()
        w = weights[0].float()
        w = w / w.sum()
        order = w.argsort(descending=True)
        low, acc = set(), 0.0
        for j in order.tolist():
            e = int(idx[0, j])
            cached = self.cache is not None and (layer, e) in self.cache
            if acc > self.policy.t2 and self.policy.skip_past_t2 and not cached:
                self.skip.add((layer, e))
            elif acc > self.policy.t1:
                low.add(e)
            acc += float(w[j])
        return low

    def _issue_deferred(self) -> None:
        """Submit planned reads ahead, nearest layer and most probable first, while fewer than max_inflight are."""
        while self.deferred and len(self.prefetches) < self.max_inflight:
            key = next(iter(self.deferred))
            bits, prio = self.deferred.pop(key)
            if self.host is not None and self.host.holds(key, bits):  # no store read: up from the host tier
                self._ready_from_host(key, bits)
                continue
            req = self._submit(key, bits, prio)
            self.prefetches[key] = Fetch(req, bits, prefetched=True)

    def _cached(self, key: Key) -> bool:
        return self.cache is not None and key in self.cache

    # ---------------------------------------------------------------- serving
    def stream(self, layer: int, expert_ids: Iterable[int]) -> Iterator[tuple[int, Expert | None]]:
        """Yield (expert id, callable expert or None if skipped): cached first, then in arrival order."""
        for group in self.stream_groups(layer, expert_ids):
            yield from group

    def stream_groups(self, layer: int, expert_ids: Iterable[int]) -> Iterator[list[tuple[int, Expert | None]]]:
        """:meth:`stream` in groups: first every cached (pinned till :meth:`end_layer`) or skipped expert, then the
        reads that have landed, together, as they land (their read buffers may go back to the pool once the caller
        asks for the next group)."""
        info = AccessInfo(layer_now=layer, num_layers=self.config.num_hidden_layers)
        pending: dict[int, Fetch] = {}
        at_hand: list[tuple[int, Expert | None]] = []
        for e in expert_ids:
            key = (layer, e)
            entry = self.cache.get(key) if self.cache is not None else None
            if entry is not None:
                at_hand.append((e, self._use_cached(key, entry, info)))  # pinned, a hit or a prefetch's first use
            elif key in self.skip:
                self.skip.discard(key)
                self.stats.skipped += 1
                at_hand.append((e, None))
            else:
                f = self.prefetches.pop(key, None) or self.demands.pop(key, None)
                if f is None and self._host_holds(key):
                    at_hand.append((e, self._from_host(key, info)))
                    continue
                if f is None:  # not announced through on_route (a provider used without the hook)
                    f = Fetch(
                        self._submit(key, self.policy.bits, Priority.DEMAND),
                        self.policy.bits,
                        prefetched=False,
                    )
                pending[e] = f
        self._issue_deferred()  # this layer's prefetches left self.prefetches: room for the layers ahead
        if at_hand:
            t0 = time.perf_counter()
            yield at_hand
            # the caller computed them before asking for more
            self._time_experts(sum(expert is not None for _, expert in at_hand), time.perf_counter() - t0)
        try:
            while pending:
                ready = [e for e, f in pending.items() if f.req.done.is_set()]
                if not ready:
                    self._land()  # reads ahead that landed meanwhile: counted as consume time, not stall
                    t0 = time.perf_counter()
                    self._free_staging()
                    with self.fetch.completed:
                        if not any(f.req.done.is_set() for f in pending.values()):
                            self.fetch.completed.wait(timeout=0.05)
                    self.stats.stall_s += time.perf_counter() - t0
                    continue
                landed: list[Fetch] = []
                try:
                    group = []
                    for e in ready:
                        landed.append(f := pending.pop(e))
                        group.append((e, self._consume(layer, e, f, info)))
                    yield group
                finally:  # the caller is done with these experts: their buffers may take the next reads
                    for f in landed:
                        if f.lent:
                            self._lent.append(f.req) if self._hold_lent else self.fetch.release(f.req)
        except BaseException:  # a failed read, or the request abandoned mid-layer: return every buffer
            for f in pending.values():
                self._drop(f, wasted=False)
            raise

    def get(self, layer: int, expert: int):
        """One expert through :meth:`stream` (cache, a fetch in flight, or a demand read); pinned until
        :meth:`end_layer`, as in the model's flow. None if precision-on-miss skipped it."""
        self._hold_lent = True  # the caller uses the expert after the stream ends: keep its buffer till end_layer
        try:
            [(_, out)] = list(self.stream(layer, [expert]))
        finally:
            self._hold_lent = False
        return out

    def _consume(self, layer: int, e: int, f: Fetch, info: AccessInfo):
        key = (layer, e)
        t0 = time.perf_counter()
        payload = self._take(f)
        low = f.bits != self.policy.bits
        if self.cache is not None:
            self.cache.access(key, False, AccessInfo(info.layer_now, info.num_layers, low_precision=low))
        release = self._into_tier(key, f.req, payload, info)  # kept in host memory: its next miss reads no store
        # Cold copies serve this use only; caching them would lower later answers' precision.
        if not low and (self.zero_copy or self.lends):
            # Computed in its read buffer: kept as the cached expert's memory if the cache admits it (zero-copy), else
            # lent for this use and back to the pool after it (load-on-demand, or a cache that declined it). A copy
            # out would allocate fresh memory per read that no device's DMA needs (dear where page faults are:
            # docs/measured-choices.md).
            expert = self._decode_in_buffer(f)
            if not (self.zero_copy and self._hand_off(key, f, expert)):
                f.lent = True
                self.lent_reads += 1
        else:
            # The staging buffer goes back to the pool only once the copy out of it has completed.
            expert, _ = self._upload(key, payload, f.bits, not f.prefetched, release)
        self._evicted.clear()  # buffers of evicted experts not reused here are freed with their last user
        self.stats.consume_s += time.perf_counter() - t0
        nbytes = f.req.ref.length
        if f.prefetched:
            self._prefetch_used(layer, nbytes)
        else:
            self.stats.misses += 1
            self.stats.demand_bytes += nbytes
            self._count_use(layer, 2)
        self.stats.low_precision += int(low)
        return expert

    def _take(self, f: Fetch) -> memoryview:
        """A landed read's payload (its buffer back to the pool if the read failed); its speed measured."""
        try:
            payload = self.fetch.wait(f.req)
        except BaseException:
            self.fetch.release(f.req)
            self._abandon(f.req)  # a read into a host-tier slot: the slot free again, never marked held
            raise
        if f.req.read_s > 0:
            self._read_bw = _ema(self._read_bw, f.req.ref.length / f.req.read_s, 0.8)
            self._read_cpu = _ema(self._read_cpu, f.req.cpu_s, 0.9)
        return payload

    def _prefetch_used(self, layer: int, nbytes: int) -> None:
        self.stats.prefetch_hits += 1
        self.stats.prefetch_bytes += nbytes
        self._count_use(layer, 1)

    def _free_staging(self) -> None:
        """Give back the staging buffers whose copies to the device have landed, while a layer waits for reads: the
        readers need them. With every buffer still copying, wait for the oldest copy (a DMA, bounded) rather than
        for a read that no reader can start without a buffer (the layer would block forever)."""
        if self.copier.in_flight and self.copier.poll() and self.fetch.pool.available == 0:
            self.copier.wait_oldest()

    def _hand_off(self, key: Key, f: Fetch, expert: object) -> bool:
        """Zero-copy: if the cache admits ``expert`` (decoded in its read buffer; charged the whole buffer), keep the
        buffer as the cached expert's memory (the pool gets an evicted expert's buffer or a new one in its place).
        False if refused: the buffer stays the request's."""
        assert self.cache is not None and f.req.buffer is not None  # zero-copy: a cache, a read buffer
        if not self._admit(key, expert, f.req.buffer.size, f.bits):
            return False
        if self._holds_model and f.req.into is None:  # kept for the whole run, its buffer its own: its int4 codes
            into_rows_of_four(expert)  # into rows of four where that pays (a host tier's slot stays as read)
        self._kept[key] = self.fetch.hand_off(f.req, self._unused_evicted())
        self.cache.pin(key)
        self.in_use.append(key)
        return True

    def _decode_in_buffer(self, f: Fetch):
        """The expert as views of its read buffer (the whole buffer is the storage: what a cached entry keeps)."""
        assert f.req.buffer is not None  # a completed read's
        blob = torch.frombuffer(f.req.buffer.view, dtype=torch.uint8)
        return decode_expert(blob[: f.req.ref.length], self.store.precisions[f.bits], self.dtype)

    def _admit(self, key: Key, expert: object, nbytes: int, bits: int) -> bool:
        """Cache ``expert``; in prefill under ``keep_preloaded`` only into free room (nothing evicted)."""
        assert self.cache is not None  # called only with one
        if self.policy.keep_preloaded and self._prefill and not self.cache.has_room(key, nbytes):
            return False
        return self.cache.insert(key, expert, nbytes, bits)

    def _unused_evicted(self) -> Buffer | None:
        """An evicted expert's buffer no tensor points into any more (its memory already faulted in, so the
        reader does not pay for fresh pages), or None; the others are left to be freed with their last user."""
        while self._evicted:
            buf = self._evicted.pop()
            if sys.getrefcount(buf.view) <= 2:  # only buf.view and this call: no tensor decoded in it is alive
                return buf
        return None

    def _count_use(self, layer: int, kind: int) -> None:
        self.layer_uses.setdefault(layer, [0, 0, 0])[kind] += 1

    def end_layer(self, layer: int) -> None:
        if not self._busy() and self._all_cached():  # a model cached whole: only the layer's pins to let go
            self._release_lent()
            self._unpin_all()
            return
        self.copier.poll()
        self._release_lent()
        self._unpin_all()
        for key in [k for k in self._landed if k[0] == layer]:  # made ready, never used
            self.stats.wasted_bytes += self._landed.pop(key)
        for key in [k for k in self.prefetches if k[0] == layer]:  # predicted, never used: drop
            self._drop(self.prefetches.pop(key), wait=False)
        self._land()  # the layers ahead's reads that have landed: ready before their layers route
        self._settle(wait=layer == self.config.moe_layers[-1])  # a token's counters are complete at its end
        self._issue_deferred()
        # What still waits for room would start after its layer's demand reads: left to them.
        nxt = min((m for m in self.layer_index if m > layer), default=None)
        for key in [k for k in self.deferred if k[0] <= (layer if nxt is None else nxt)]:
            del self.deferred[key]
        self.skip = {k for k in self.skip if k[0] != layer}

    def _unpin_all(self) -> None:
        """Unpin what this layer used: its cached experts, and the host-tier blobs its misses came from."""
        if self.cache is not None:
            for key in self.in_use:
                self.cache.unpin(key)
        self.in_use.clear()
        if self.host is not None:
            for key in self._host_held:
                self.host.unpin(key)
        self._host_held.clear()

    def _drop(self, f: Fetch, wasted: bool = True, wait: bool = True) -> None:
        """Cancel a fetch (stopping its read between chunks), give its buffer back, count what it wasted.
        ``wait=False``: a read in progress is settled later (:meth:`_settle`) instead of blocking this thread
        until the reader reaches its next chunk (the reader returns the buffer itself when it stops)."""
        self.fetch.cancel(f.req)
        if not wait and not f.req.done.is_set():
            self._dropping.append((f, wasted))
            return
        f.req.done.wait()
        if wasted:
            self.stats.wasted_bytes += f.req.bytes_read
        self.fetch.release(f.req)
        self._abandon(f.req)

    def _settle(self, wait: bool) -> None:
        """Account the cancelled reads that have stopped (all of them, waiting, if ``wait``)."""
        dropping, self._dropping = self._dropping, []
        for f, wasted in dropping:
            self._drop(f, wasted, wait=wait)

    def _release_lent(self) -> None:
        for req in self._lent:
            self.fetch.release(req)
        self._lent.clear()

    def abort(self) -> None:
        """Drop everything in flight and unpin everything in use: after a failed or abandoned request."""
        self._settle(wait=True)
        self._release_lent()
        for f in self.prefetches.values():
            self._drop(f)
        for f in self.demands.values():
            self._drop(f, wasted=False)
        self.prefetches.clear()
        self.deferred.clear()
        self.demands.clear()
        self._landed.clear()
        self._unpin_all()
        self.skip.clear()
        self.copier.drain()

    def forget_stats(self) -> None:
        """Drop the statistics of work no request asked for (the load's reads, the warm-up's tokens)."""
        self.stats, self.layer_uses = SchedulerStats(), {}

    def new_sequence(self) -> None:
        """Start of a request: reset per-request predictor state and per-sequence cache statistics."""
        self.abort()
        self.last_prediction.clear()
        self._candidates.clear()
        self._last_route = None
        if self.predictor is not None:
            self.predictor.reset()
        if self.cache is not None:
            self.cache.new_sequence()
