"""Prometheus text exposition (format 0.0.4) of the daemon's ``fate_edge_*`` series, without a client library."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

from fate_edge.process_memory import peak_rss_bytes

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    esc = {k: str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for k, v in labels.items()}
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(esc.items())) + "}"


def _num(v: float) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, int):
        return str(v)
    return repr(float(v)) if v == v else "NaN"


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
        self.sum += v
        self.count += 1


class Metrics:
    """Counters kept by the daemon; engine figures are read live from the engine at scrape time."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = defaultdict(int)  # (endpoint, status) → count
        self.latency: dict[str, Histogram] = {}
        self.ttft: dict[str, Histogram] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cancelled = 0
        self.failed = 0
        self.generation_seconds = 0.0
        self.last_generation_tps = 0.0

    def request(self, endpoint: str, status: int, seconds: float) -> None:
        with self._lock:
            self.requests[(endpoint, str(status))] += 1
            self.latency.setdefault(endpoint, Histogram(LATENCY_BUCKETS)).observe(seconds)

    def first_token(self, endpoint: str, seconds: float) -> None:
        with self._lock:
            self.ttft.setdefault(endpoint, Histogram(TTFT_BUCKETS)).observe(seconds)

    def job_finished(self, job: Any) -> None:
        last = job.last
        with self._lock:
            if job.state == "cancelled":
                self.cancelled += 1
            elif job.state == "failed":
                self.failed += 1
            if last is not None:
                self.prompt_tokens += last.prompt_tokens
                self.generation_tokens += last.generation_tokens
                if last.generation_tps > 0:
                    self.generation_seconds += last.generation_tokens / last.generation_tps
                    self.last_generation_tps = last.generation_tps

    def render(self, engine: Any, runner: Any, loaded: bool, model_id: str, policy: str) -> str:
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[dict[str, str], float]]) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                out.append(f"{name}{_labels(labels)} {_num(value)}")

        def histogram(name: str, help_: str, hists: dict[str, Histogram]) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} histogram")
            for endpoint, h in sorted(hists.items()):
                for b, c in zip(h.buckets, h.counts):
                    out.append(f"{name}_bucket{_labels({'endpoint': endpoint, 'le': _num(b)})} {c}")
                out.append(f"{name}_bucket{_labels({'endpoint': endpoint, 'le': '+Inf'})} {h.count}")
                out.append(f"{name}_sum{_labels({'endpoint': endpoint})} {_num(h.sum)}")
                out.append(f"{name}_count{_labels({'endpoint': endpoint})} {h.count}")

        with self._lock:
            metric("fate_edge_info", "gauge", "Served model and policy.", [({"model": model_id, "policy": policy}, 1)])
            metric(
                "fate_edge_model_loaded",
                "gauge",
                "1 once the model is loaded and requests are served.",
                [({}, int(loaded))],
            )
            metric(
                "fate_edge_requests_total",
                "counter",
                "HTTP requests by endpoint and status code.",
                [({"endpoint": e, "status": s}, n) for (e, s), n in sorted(self.requests.items())],
            )
            histogram(
                "fate_edge_request_duration_seconds", "Request latency, first byte in to last byte out.", self.latency
            )
            histogram(
                "fate_edge_time_to_first_token_seconds", "Queueing plus prefill until the first token.", self.ttft
            )
            metric(
                "fate_edge_requests_cancelled_total",
                "counter",
                "Generations stopped because the client disconnected.",
                [({}, self.cancelled)],
            )
            metric(
                "fate_edge_requests_failed_total",
                "counter",
                "Generations that failed with a server error.",
                [({}, self.failed)],
            )
            metric("fate_edge_prompt_tokens_total", "counter", "Prompt tokens processed.", [({}, self.prompt_tokens)])
            metric("fate_edge_generation_tokens_total", "counter", "Tokens generated.", [({}, self.generation_tokens)])
            metric(
                "fate_edge_generation_seconds_total",
                "counter",
                "Time spent generating tokens (decode).",
                [({}, self.generation_seconds)],
            )
            metric(
                "fate_edge_generation_tokens_per_second",
                "gauge",
                "Decode speed of the last request.",
                [({}, self.last_generation_tps)],
            )
        metric(
            "fate_edge_requests_running",
            "gauge",
            "Generations running now (at most --max-batch).",
            [({}, runner.running if runner else 0)],
        )
        metric(
            "fate_edge_requests_waiting",
            "gauge",
            "Generations waiting in the queue.",
            [({}, runner.waiting if runner else 0)],
        )
        metric(
            "fate_edge_queue_capacity",
            "gauge",
            "Most requests that may wait (--max-queue).",
            [({}, runner.max_queue if runner else 0)],
        )
        metric(
            "fate_edge_peak_rss_bytes",
            "gauge",
            "Peak resident set size of the process (VmHWM).",
            [({}, peak_rss_bytes())],
        )
        try:
            import psutil

            metric(
                "fate_edge_rss_bytes",
                "gauge",
                "Resident set size of the process now.",
                [({}, psutil.Process().memory_info().rss)],
            )
        except Exception:  # pragma: no cover - psutil is a dependency, but metrics must not fail
            pass
        batcher = getattr(engine, "batcher", None)
        b = batcher.stats if batcher is not None else None
        metric(
            "fate_edge_batch_max_size",
            "gauge",
            "Most sequences one step may carry (--max-batch).",
            [({}, engine.max_batch if engine is not None else 0)],
        )
        metric("fate_edge_batch_size", "gauge", "Sequences in the running batch now.", [({}, b.active if b else 0)])
        metric(
            "fate_edge_batch_queue",
            "gauge",
            "Requests waiting to join the batch (room or KV budget).",
            [({}, b.waiting if b else 0)],
        )
        metric(
            "fate_edge_batch_mean_size",
            "gauge",
            "Mean sequences per batched step since start.",
            [({}, b.sequences_stepped / b.steps if b and b.steps else 0.0)],
        )
        metric("fate_edge_batch_steps_total", "counter", "Batched forward steps run.", [({}, b.steps if b else 0)])
        metric(
            "fate_edge_batch_kv_reserved_bytes",
            "gauge",
            "KV cache reserved by the batch's sequences.",
            [({}, b.kv_reserved_bytes if b else 0)],
        )
        _prompt_cache(metric, getattr(engine, "prompt_cache", None))
        if engine is not None:
            s = engine.stats
            metric(
                "fate_edge_memory_budget_bytes",
                "gauge",
                "Hard budget for expert memory (--memory-budget).",
                [({}, engine.budget)],
            )
            metric(
                "fate_edge_expert_cache_capacity_bytes",
                "gauge",
                "Part of the budget given to the expert cache.",
                [({}, engine.plan.cache_bytes)],
            )
            metric(
                "fate_edge_expert_cache_used_bytes",
                "gauge",
                "Expert cache bytes in use.",
                [({}, engine.cache.used_bytes if engine.cache is not None else 0)],
            )
            metric(
                "fate_edge_read_buffer_bytes",
                "gauge",
                "Read buffers allocated once inside the budget.",
                [({}, engine.plan.pool_bytes)],
            )
            metric("fate_edge_expert_cache_hits_total", "counter", "Expert uses served from the cache.", [({}, s.hits)])
            metric(
                "fate_edge_expert_prefetch_hits_total",
                "counter",
                "Expert uses served by a prefetch issued before the layer needed it.",
                [({}, s.prefetch_hits)],
            )
            metric(
                "fate_edge_expert_misses_total",
                "counter",
                "Expert uses that waited for a demand read.",
                [({}, s.misses)],
            )
            metric(
                "fate_edge_expert_hit_ratio", "gauge", "(hits + prefetch hits) / uses since start.", [({}, s.hit_rate)]
            )
            metric(
                "fate_edge_expert_bytes_read_total",
                "counter",
                "Expert bytes read from storage: demand (critical path), prefetch (used), wasted (never used).",
                [
                    ({"kind": "demand"}, s.demand_bytes),
                    ({"kind": "prefetch"}, s.prefetch_bytes),
                    ({"kind": "wasted"}, s.wasted_bytes),
                ],
            )
            metric(
                "fate_edge_prefetch_predictions_total",
                "counter",
                "Decode-time expert predictions checked.",
                [({}, s.predictions)],
            )
            metric(
                "fate_edge_prefetch_exact_total",
                "counter",
                "Predictions whose top-k equalled the true experts.",
                [({}, s.exact)],
            )
            metric(
                "fate_edge_prefetch_accuracy_ratio",
                "gauge",
                "Share of exact predictions (prefetch accuracy).",
                [({}, s.exact_match)],
            )
            metric(
                "fate_edge_prefetch_recall_ratio",
                "gauge",
                "Mean recall of the true experts in predictions.",
                [({}, s.recall)],
            )
            metric(
                "fate_edge_stall_seconds_total",
                "counter",
                "Time the forward pass waited for expert bytes.",
                [({}, s.stall_s)],
            )
            metric(
                "fate_edge_fetch_failures_total",
                "counter",
                "Expert reads that failed.",
                [({}, engine.fetch.stats.failures)],
            )
        return "\n".join(out) + "\n"


def _prompt_cache(metric: Any, cache: Any) -> None:
    """The prompt cache's series (runtime.prompt_cache); zeros with the cache off (--prompt-cache 0)."""
    st = cache.stats if cache is not None else None
    for name, kind, help_, value in (
        ("hits_total", "counter", "Requests that started from a kept prompt prefix.", st.hits if st else 0),
        ("misses_total", "counter", "Requests that looked for a kept prefix and found none.", st.misses if st else 0),
        ("tokens_saved_total", "counter", "Prompt tokens not prefilled (kept).", st.tokens_saved if st else 0),
        ("evictions_total", "counter", "Kept prefixes dropped for room.", st.evictions if st else 0),
        ("bytes", "gauge", "KV bytes the prompt cache holds now.", st.bytes_held if st else 0),
        ("capacity_bytes", "gauge", "The prompt cache's room in the memory account.", cache.room_bytes if cache else 0),
        ("entries", "gauge", "Kept prefixes held now.", st.entries if st else 0),
    ):
        metric(f"fate_edge_prompt_cache_{name}", kind, help_, [({}, value)])
