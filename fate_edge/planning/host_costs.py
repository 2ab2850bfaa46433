"""This host's costs, measured by probe runs of the engine itself: per-layer decode compute, what an expert read
costs the CPU (the reader thread, decoding the blob), the disk's bandwidth; and a device's layer time from its
roofline."""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from fate_edge import defaults
from fate_edge.devices.detect import reader_contention
from fate_edge.devices.emulate import device_roofline
from fate_edge.devices.link import LinkSpec
from fate_edge.planning.plan_trace import PlanTrace, reads_early_attention, trace_predictions
from fate_edge.planning.simulate import HostCosts
from fate_edge.runtime.policy import PRESETS, PolicyConfig


@dataclass
class ProbeRun:
    tokens: int  # decode tokens measured
    compute_s: float  # the median token's compute (time less stall and blob decoding) x tokens
    stall_s: float
    consume_s: float
    predict_s: float
    reads: int  # reads completed by the fetch engine during decode (used or not)
    reader_cpu_s: float
    read_s: float
    bytes_read: int
    trace: PlanTrace | None = None  # the decode's routing and predictor scores (record=True)
    decode_s: float = 0.0  # wall time from the first streamed token to the last (``tokens`` decode steps)
    expert_s: float = 0.0  # the caller's compute per cached expert use (SchedulerStats.expert_s), median token's
    compute_sum_s: float = 0.0  # every token's compute summed (hiccups of the host included)


class _DecodeRecorder:
    """Routing observer: each decode step's gate inputs and experts, and the prompt's experts per layer (with
    ``early``, an early_attention.EarlyInput, also each step's early-attention estimate)."""

    def __init__(self, early=None) -> None:
        self.h: dict[int, list[torch.Tensor]] = {}
        self.ids: dict[int, list[torch.Tensor]] = {}
        self.warm: dict[int, list[int]] = {}
        self.early_attention = early
        self.early: dict[int, list[torch.Tensor]] = {}

    def __call__(self, layer: int, h: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> None:
        if h.shape[0] > 1:  # prefill: the union, most popular first, as the engine loads it
            ids, counts = idx.flatten().unique(return_counts=True)
            self.warm[layer] = ids[counts.argsort(descending=True, stable=True)].tolist()
            return
        self.h.setdefault(layer, []).append(h.detach().float().clone())
        self.ids.setdefault(layer, []).append(idx.detach().clone())
        if self.early_attention is not None and layer in self.early_attention.next:
            self.early.setdefault(layer, []).append(self.early_attention.estimate(layer, h))


def token_compute_s(times: list[float], token_stats: list) -> list[float]:
    """Each decode token's compute: the time between consecutive ``times`` (one per streamed token) less its stall
    and blob decoding (``token_stats``, the engine's per-token stats, in order)."""
    return [dt - s.stall_s - s.consume_s for dt, s in zip(np.diff(times), token_stats)]


def expert_compute_s(token_stats: list) -> float:
    """One cached expert's compute in decode: per token, the time its cached experts took over their number; the
    median over tokens (a hiccup of the host in one token does not skew it); 0 when none was cached."""
    per = [s.expert_s / s.experts_timed for s in token_stats if s.experts_timed]
    return float(np.median(per)) if per else 0.0


def probe_engine(
    store_dir,
    budget: int,
    policy: PolicyConfig,
    link: LinkSpec | None,
    token_ids: list[int],
    dtype: torch.dtype,
    tokens: int = 16,
    workers: int = defaults.FETCH_WORKERS,
    record: bool = False,
    direct_io: bool | None = None,
    resident_bits: int | None = None,
) -> ProbeRun:
    """Decode ``tokens`` greedy tokens after ``token_ids`` with the real engine under ``budget``; the second
    of two runs is measured (the first warms torch's kernels and checks each blob's CRC once, as a
    long-running engine would have). ``record``: also keep the decode's routing as a :class:`PlanTrace`.
    ``direct_io``: O_DIRECT reads (default: only without a link, i.e. from the raw disk). ``resident_bits``: the
    engine's resident linears quantized (8 or 4), as the run being planned holds them."""
    from fate_edge.devices.link import ThrottledLink
    from fate_edge.runtime.engine import Engine
    from fate_edge.runtime.engine_config import EngineConfig
    from fate_edge.runtime.generate import GenerateConfig

    run = None
    for attempt in range(2):
        eng = Engine(
            EngineConfig(
                store_dir,
                budget,
                policy,
                dtype=dtype,
                link=ThrottledLink(link) if link else None,
                workers=workers,
                direct_io=link is None if direct_io is None else direct_io,
                resident_bits=resident_bits,
            )
        )
        rec = None
        if record and attempt == 1:
            from fate_edge.predictors.early_attention import EarlyInput

            rec = _DecodeRecorder(EarlyInput(eng.model) if reads_early_attention(store_dir) else None)
        if rec is not None:
            eng.model.observers.insert(0, rec)
        try:
            times, f0 = [], None
            for _resp in eng.stream(token_ids, GenerateConfig(max_tokens=tokens + 1, ignore_eos=True)):
                times.append(time.perf_counter())
                if f0 is None:  # the first token ends prefill: measure decode from here
                    f0 = dataclasses.replace(eng.fetch.stats)
            f1 = eng.fetch.stats
            assert f0 is not None  # max_tokens >= 1: a first token always ends prefill
            st = eng.token_stats
            # Compute per token = its time minus its stall and blob decoding; the median over tokens, so a
            # hiccup of the host (another process, page-cache writeback) does not skew it.
            compute = token_compute_s(times, st)
            run = ProbeRun(
                len(st),
                float(np.median(compute)) * len(st),
                sum(s.stall_s for s in st),
                sum(s.consume_s for s in st),
                sum(s.predict_s for s in st),
                f1.reads_completed - f0.reads_completed,
                f1.cpu_s - f0.cpu_s,
                f1.read_s - f0.read_s,
                f1.bytes_read - f0.bytes_read,
                decode_s=times[-1] - times[0],
                expert_s=expert_compute_s(st),
                compute_sum_s=float(np.sum(compute)),
            )
            if rec is not None and rec.ids:
                ids = {layer: torch.cat(v) for layer, v in rec.ids.items()}
                h = {layer: torch.cat(v) for layer, v in rec.h.items()}
                early = {layer: torch.cat(v) for layer, v in rec.early.items()} if rec.early else None
                run.trace = trace_predictions(eng.model, ids, h, store_dir=store_dir, early=early)
                run.trace.warm = rec.warm
                run.trace.probe_tokens_per_s = (len(times) - 1) / run.decode_s if run.decode_s > 0 else None
        finally:
            eng.close()
            del eng
            gc.collect()  # the next engine starts without this one's objects (a later GC pass would be timed)
    assert run is not None
    return run


def probe_point(run: ProbeRun) -> tuple[float, float]:
    """A probe's (stall, compute) per decode token, mean over its tokens; compute leaves out the predictor's time
    (charged apart, as ``predict_s``)."""
    n = max(1, run.tokens)
    return run.stall_s / n, ((run.compute_sum_s or run.compute_s) - run.predict_s) / n


def stall_drag(points: list[tuple[float, float]], fallback: float) -> tuple[float, float]:
    """Compute per token with no stall, and the extra compute per second of stall, from (stall, compute) per token
    of two probe runs: the line through both. Where their stalls are too close to tell a slope (closer than two
    thousandths of a second or a fifth of the larger), or compute does not grow with stall, (``fallback``, 0). The slope
    is capped so that compute with no stall is at least half the smaller measured one: two short probes on a shared host
    give no more evidence."""
    (s1, c1), (s2, c2) = sorted(points)
    if s2 - s1 < max(2e-3, 0.2 * s2) or c2 <= c1:
        return fallback, 0.0
    floor = 0.5 * min(c1, c2)
    slope = min((c2 - c1) / (s2 - s1), (c1 - floor) / s1 if s1 > 0 else float("inf"))
    return c1 - slope * s1, slope


def measure_host_costs(
    store_dir,
    budget: int,
    link: LinkSpec | None,
    token_ids: list[int],
    dtype: torch.dtype = torch.float32,
    predictor_policy: PolicyConfig | None = None,
    workers: int = defaults.FETCH_WORKERS,
    decode_tokens: int = 128,
    progress: Callable[[str], None] | None = None,
    direct_io: bool | None = None,
    predictor_probe: bool = True,
    resident_bits: int | None = None,
    preset: PolicyConfig | None = None,
) -> tuple[HostCosts, LinkSpec, PlanTrace | None]:
    """The simulator's constants for this host and a decode trace, from probe runs of the engine under
    ``budget``: an LRU cache without prediction decoding ``decode_tokens`` tokens after ``token_ids`` (all
    reads are demand reads, so what is not stalling or decoding blobs is compute; its routing is the
    trace); then ``preset`` (the device's preset) for up to 32 tokens, whose stall differs from the LRU probe's: the
    two give compute as a function of stall (:func:`stall_drag`), and a preset with a predictor its cost; then,
    where no predictor cost was measured yet, the predictor's policy for a few tokens (skipped, with no predictor
    cost, when ``predictor_probe`` is False). Without
    ``link`` the disk is read with O_DIRECT and its bandwidth is the one measured. ``progress`` is told
    before each probe. ``resident_bits``: the probes' resident linears quantized (8 or 4)."""
    from fate_edge.model.arch import load_config

    say = progress or (lambda message: None)
    moe_layers = len(load_config(store_dir).moe_layers)
    # The probes this call runs: the LRU one; the preset's; the predictor's, where the preset runs none.
    total = 1 + (preset is not None) + (predictor_probe and (preset is None or preset.predictor is None))
    say(f"probe 1/{total}: {decode_tokens} tokens with an LRU cache and no prediction (compute, reads, routing)")
    base = probe_engine(
        store_dir,
        budget,
        PRESETS["lru"],
        link,
        token_ids,
        dtype,
        tokens=decode_tokens,
        workers=workers,
        record=True,
        direct_io=direct_io,
        resident_bits=resident_bits,
    )
    reads = max(1, base.reads)
    contention = reader_contention(torch.get_num_threads(), workers)
    # The mean token's compute, not the median's: what is predicted is decode tokens over wall time, which the
    # host's hiccups lengthen as much in the planned run as in the probe (a median-based compute predicted
    # every pick faster than measured on a loaded host).
    compute = (base.compute_sum_s or base.compute_s) / max(1, base.tokens) / moe_layers
    predict_s, drag = 0.0, 0.0

    def probe(policy: PolicyConfig, tokens: int) -> ProbeRun:
        return probe_engine(
            store_dir,
            budget,
            policy,
            link,
            token_ids,
            dtype,
            tokens=tokens,
            workers=workers,
            direct_io=direct_io,
            resident_bits=resident_bits,
        )

    if preset is not None:
        # The preset at its own stall level (it caches and prefetches; the LRU probe waits on every miss): compute
        # per token as the line through both runs' (stall, compute) (stall_drag). Ungated, so a predictor runs on
        # every layer call and its cost per call is measured too.
        say(f"probe 2/{total}: {min(32, decode_tokens)} tokens of the preset (compute at its stall level)")
        pre = probe(preset.with_(prefetch_gate=False), min(32, decode_tokens))
        per_token, drag = stall_drag([probe_point(base), probe_point(pre)], compute * moe_layers)
        compute = per_token / moe_layers
        if pre.predict_s > 0:
            predict_s = pre.predict_s / max(1, pre.tokens) / moe_layers
    if predictor_probe and predict_s == 0.0:
        # Ungated, so the predictor runs on every layer call and its cost per call is what is measured.
        say(f"probe {total}/{total}: a few tokens with the predictor on every layer (its cost)")
        pred = probe((predictor_policy or PRESETS["fate-edge"]).with_(prefetch_gate=False), 16)
        predict_s = pred.predict_s / max(1, pred.tokens) / moe_layers
    costs = HostCosts(
        layer_compute_s=max(1e-6, compute),
        predict_s=predict_s,
        read_cpu_s=base.reader_cpu_s / reads if base.reads else 0.0,
        consume_s=base.consume_s / reads if base.reads else 0.0,
        contention=contention,
        expert_s=base.expert_s,
        stall_drag=drag,
    )
    if link is None:
        bw = base.bytes_read / base.read_s if base.read_s > 0 else 1e9
        link = LinkSpec("this host's disk (measured)", bw, 0.0)
    return costs, link, base.trace


def roofline_layer_time(cfg, profile, expert_bytes: int, resident_layer_bytes: int) -> float:
    """Per-layer decode time on a device: its roofline (devices/emulate.py) over the layer's resident weights at
    fp16 and its top-k experts."""
    flops = 2 * (resident_layer_bytes / 2 + cfg.num_experts_per_tok * cfg.expert_params)
    read = resident_layer_bytes + cfg.num_experts_per_tok * expert_bytes
    return device_roofline(profile).time_s(read, flops)
