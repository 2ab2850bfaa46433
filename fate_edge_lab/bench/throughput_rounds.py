"""The throughput mode's pieces shared by its host and emulated runs: the requests, the configuration, one round
of serving them (at once or one after another) and its figures, the store and budget, and the host's note."""

from __future__ import annotations

import os
import platform
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fate_edge_lab.bench.host import cpu_model, load_average

PROMPTS = [
    "def main():",
    "import os\nimport sys\n",
    "class Point:\n    def __init__(self, x",
    "x = ",
    "# read the file line by line\n",
    "for i in range(10):",
    "def parse(line):",
    "from typing import",
    "if __name__ ==",
    "while True:",
    "return [x for",
    "with open(path) as f:",
    "try:\n    import",
    "print(",
    "async def fetch(",
    "@dataclass\nclass Config:",
]


@dataclass
class ThroughputConfig:
    model: str | None = None  # expert store or model directory (None: the bundled model)
    budget_fraction: float = 0.35  # of every expert at the streamed precision
    concurrency: int = 8
    max_tokens: int = 32
    rounds: int = 3
    threads: int = 2
    policy: str = "fate-edge"
    dtype: str = "float32"
    resident_bits: int | None = None  # 4 or 8: attention, shared experts and lm_head quantized at load
    device: str = "cpu"  # cpu, cuda or cuda:N (the GPU check runs it on cuda)
    emulate: str | None = None  # a device (orin-nano, ...): device-faithful emulation (bench.throughput_emulated)


def bench_prompts(n: int) -> list[str]:
    """``n`` of the bench's prompts, from the first, cycling past the list's end."""
    return [PROMPTS[i % len(PROMPTS)] for i in range(n)]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


def serve_request(engine, prompt: str, max_tokens: int, t_submit: float, record: dict) -> None:
    """One request streamed to its end: into ``record``, its time to first token (from ``t_submit``), the gaps
    between its tokens (seconds) and its token count."""
    from fate_edge.runtime.generate import GenerateConfig

    times = []
    for _ in engine.stream(prompt, GenerateConfig(max_tokens=max_tokens, ignore_eos=True)):
        times.append(time.perf_counter())
    record["ttft"] = times[0] - t_submit
    record["gaps"] = [b - a for a, b in zip(times, times[1:])]
    record["tokens"] = len(times)


def run_round(engine, prompts: list[str], max_tokens: int, concurrent: bool, at_once: int = 0) -> dict:
    """One round: every prompt served (at once, or one after another; ``at_once``: in waves of that many at once,
    each wave after the one before); the round's figures, over every request."""
    s0 = engine.stats.snapshot()
    records: list[dict[str, Any]] = [{} for _ in prompts]
    t0 = time.perf_counter()
    if concurrent:
        wave = at_once or len(prompts)
        for w in range(0, len(prompts), wave):
            threads = [
                threading.Thread(target=serve_request, args=(engine, p, max_tokens, t0, r))
                for p, r in zip(prompts[w : w + wave], records[w : w + wave])
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    else:
        for p, r in zip(prompts, records):
            serve_request(engine, p, max_tokens, t0, r)  # a request's TTFT includes waiting for the ones before it
    wall = time.perf_counter() - t0
    s = engine.stats.minus(s0)
    tokens = sum(r["tokens"] for r in records)
    gaps = [g for r in records for g in r["gaps"]]
    ttft = [r["ttft"] for r in records]
    read = s.demand_bytes + s.prefetch_bytes + s.wasted_bytes
    return {
        "wall_s": wall,
        "tokens": tokens,
        "tok_s": tokens / wall,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p90_s": percentile(ttft, 0.9),
        "token_p50_s": percentile(gaps, 0.5),
        "token_p90_s": percentile(gaps, 0.9),
        "token_p99_s": percentile(gaps, 0.99),
        "bytes_per_token": read / max(1, tokens),
        "hit_rate": s.hit_rate,
        "stall_s_per_token": s.stall_s / max(1, tokens),
    }


def bytes_ratio(alone_bytes: float, batched_bytes: float) -> float | None:
    """Expert bytes read per token alone over batched; None where the batch read nothing (a budget that holds every
    expert: no ratio to speak of, where dividing by a floor printed 0.00x or a huge number)."""
    return alone_bytes / batched_bytes if batched_bytes > 0 else None


def ratio_text(ratio: float | None) -> str:
    """A ratio as the tables print it: ``2.00x``, or ``-`` for none."""
    return "-" if ratio is None else f"{ratio:.2f}x"


def median_rounds(rounds: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}


def engine_kwargs(cfg: ThroughputConfig) -> dict:
    """The Engine settings every engine of a run shares (besides its store, budget, batch size and link)."""
    return dict(policy=cfg.policy, dtype=cfg.dtype, device=cfg.device, resident_bits=cfg.resident_bits)


def engine_store(cfg: ThroughputConfig) -> tuple[Path, int]:
    """(the store of ``cfg.model``, converted once, and the expert budget in bytes), torch's threads set."""
    from fate_edge.bundled import bundled_model_dir
    from fate_edge.format.converted_stores import ensure_store
    from fate_edge.format.store import ExpertStore

    torch.set_num_threads(cfg.threads)
    # the baselines' store (float resident weights: cfg.resident_bits quantizes them at load)
    store = ensure_store(cfg.model or bundled_model_dir(), progress=False, baselines=True)
    s = ExpertStore(store)
    return store, int(cfg.budget_fraction * s.expert_bytes(4) * len(s.index["moe_layers"]) * s.index["num_experts"])


def host_note(device: str = "cpu") -> dict:
    """The machine a run was measured on: CPU, cores, load, torch threads and version, and the GPU on a CUDA run."""
    cpu = cpu_model() or platform.processor() or ""
    note = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "load_average": load_average(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    if device.startswith("cuda"):
        note["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return note


@dataclass
class Served:
    """Both modes' rounds: one request alone (``single``), and the N requests one at a time and batched."""

    single: list[dict]
    rounds: dict[str, list[dict]]  # "alone", "batched"
    mean_batch: float  # sequences a batched step carried, on average


def serve_both(alone, batched, prompts: list[str], cfg: ThroughputConfig) -> Served:
    """Warm both engines, time one request alone, then ``cfg.rounds`` rounds of ``prompts`` served one at a time
    by ``alone`` and at once by ``batched``, alternating which goes first."""
    run_round(alone, prompts[:2], 4, False)  # warm both: first-call allocations, kernels chosen
    run_round(batched, prompts[:2], 4, True)
    single = [run_round(alone, prompts[:1], cfg.max_tokens, False) for _ in range(cfg.rounds)]
    rounds: dict[str, list[dict]] = {"alone": [], "batched": []}
    steps = carried = 0  # the batched rounds' steps and the sequences they carried (``alone`` may be the same engine)
    for r in range(cfg.rounds):
        order = [("alone", alone, False), ("batched", batched, True)]
        for name, engine, concurrent in order if r % 2 == 0 else order[::-1]:
            b0 = (batched.batcher.stats.steps, batched.batcher.stats.sequences_stepped)
            rounds[name].append(run_round(engine, prompts, cfg.max_tokens, concurrent))
            if name == "batched":
                steps += batched.batcher.stats.steps - b0[0]
                carried += batched.batcher.stats.sequences_stepped - b0[1]
    return Served(single, rounds, carried / steps if steps else 0.0)
