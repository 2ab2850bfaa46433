"""The throughput mode on an emulated device: ``python -m fate_edge_lab.bench.throughput --emulate orin-nano``.

Device-faithful emulation (:mod:`fate_edge.planning.emulation`) runs a device's timeline ``k`` times slower, ``k`` =
this host's time / the device's time for the same compute, with the device's link dilated by ``k``; tokens/s
measured so, times ``k``, is the device-equivalent figure. One ``k`` does not fit both modes: a step of 8 rows
costs this CPU 2-3x a token (its GEMMs are compute-bound at 8 rows), while the device's roofline step of 8 rows
reads the resident weights once and the union of the rows' experts, and costs it far less than 8 tokens. So each
engine gets its own dilation, both calibrated here on the same store with every expert resident (no reads):

- ``k1``: the one-at-a-time engine's decode token on this host / one token on the device's roofline (the resident
  weights and ``top-k`` experts per MoE layer at int4; 2 FLOPs a weight);
- ``kB``: the batching engine's step on this host (the gap between a request's tokens with N requests at once) /
  that step on the roofline: the resident weights once, the union of the step's experts (counted per MoE layer in
  the same calibration run), and N tokens' FLOPs.

Each engine then serves the requests at the budget through the device's link dilated by its own ``k``; its
tokens/s times ``k`` and its latencies over ``k`` are the device's. The raw figures stay in the JSON beside them.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import torch

from fate_edge_lab.bench.throughput_rounds import (
    bench_prompts,
    bytes_ratio,
    engine_kwargs,
    engine_store,
    host_note,
    median_rounds,
    run_round,
    serve_both,
)


@dataclass(frozen=True)
class ModeDilation:
    """One engine's calibration: its step on this host and on the device, and their ratio."""

    rows: int  # decode rows a step carries (1: alone)
    host_step_s: float  # median gap between a request's tokens here, every expert resident, less stall
    union_per_layer: float  # distinct experts a step's MoE layer computes (measured)
    device_bytes: float
    device_flops: float
    device_step_s: float  # from the device's roofline
    k: float


class UnionCounter:
    """An observer of the routing: distinct experts per MoE layer call, for calls of ``rows`` rows."""

    needs_every_token = False  # it counts routing only: a prompt's last layer may still run on its last row

    def __init__(self, rows: int):
        self.rows = rows
        self.unions: list[int] = []

    def __call__(self, layer: int, h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> None:
        if idx.shape[0] == self.rows:
            self.unions.append(int(torch.unique(idx).numel()))

    @property
    def mean(self) -> float:
        return statistics.fmean(self.unions) if self.unions else float("nan")


def _host_step(engine, prompts: list[str], max_tokens: int, rounds: int, concurrent: bool) -> tuple[float, dict]:
    """Median gap between a request's tokens, less the step's mean stall, over ``rounds`` warm rounds."""

    run_round(engine, prompts, max_tokens, concurrent)  # every expert read once: later rounds hit the cache
    per = [run_round(engine, prompts, max_tokens, concurrent) for _ in range(rounds)]
    m = median_rounds(per)
    rows = len(prompts) if concurrent else 1
    return m["token_p50_s"] - m["stall_s_per_token"] * rows, m


def calibrate_modes(cfg, store, prompts: list[str]) -> tuple[dict, ModeDilation, ModeDilation]:
    """(the device's emulation facts, alone's dilation, batched's dilation) for ``cfg.emulate`` on ``store``."""
    from fate_edge.devices.emulate import device_roofline, dilated_link
    from fate_edge.devices.profile import load_profile

    from fate_edge.format.store import ExpertStore
    from fate_edge.model.arch import load_config
    from fate_edge.planning.device_costs import decode_token_work, device_link, resolve_device
    from fate_edge.planning.emulation import disk_direct_read_s
    from fate_edge.runtime.engine import Engine
    from fate_edge.runtime.engine_config import EngineConfig

    s = ExpertStore(store)
    mcfg = load_config(store)
    layers, k_top = len(mcfg.moe_layers), mcfg.num_experts_per_tok
    expert_bytes = s.expert_bytes(4)
    everything = expert_bytes * layers * s.index["num_experts"] + 4 * s.precisions[4].slot_bytes
    kw = engine_kwargs(cfg)
    n = len(prompts)
    with (
        Engine(EngineConfig(store, everything, max_batch=1, **kw)) as alone,
        Engine(EngineConfig(store, everything, max_batch=n, **kw)) as batch,
    ):
        one = UnionCounter(1)
        many = UnionCounter(n)
        alone.model.observers.append(one)
        batch.model.observers.append(many)
        host_1, raw_1 = _host_step(alone, prompts[:1], cfg.max_tokens, cfg.rounds, False)
        host_b, raw_b = _host_step(batch, prompts, cfg.max_tokens, cfg.rounds, True)
    profile_name, kind = resolve_device(cfg.emulate)
    roof = device_roofline(load_profile(profile_name))
    work = decode_token_work(store, 4, cfg.resident_bits)
    resident = work.bytes - layers * k_top * expert_bytes

    def mode(rows: int, host_s: float, union: float) -> ModeDilation:
        nbytes, flops = resident + layers * union * expert_bytes, rows * work.flops
        dev_s = roof.time_s(nbytes, flops)
        return ModeDilation(rows, host_s, union, nbytes, flops, dev_s, host_s / dev_s)

    d1, db = mode(1, host_1, one.mean), mode(n, host_b, many.mean)
    link = device_link(profile_name, kind)
    facts = {
        "device": cfg.emulate,
        "profile": profile_name,
        "roofline": asdict(roof),
        "token_work": work.what,
        "device_link": asdict(link),
        "emulated_link_alone": asdict(dilated_link(link, d1.k)),
        "emulated_link_batched": asdict(dilated_link(link, db.k)),
        "disk_direct_read_s": disk_direct_read_s(store),
        "expert_bytes": expert_bytes,
        "calibration_raw": {"alone": raw_1, "batched": raw_b},
        "note": "device-equivalent = raw tok/s x k, latencies / k; each mode has its own k (module docstring)",
    }
    return facts, d1, db


def device_equivalent(raw: dict, k: float) -> dict:
    """A round's (or median's) figures on the device's timeline: rates x k, times / k, bytes as they are."""
    out = dict(raw)
    for key in raw:
        if key == "tok_s":
            out[key] = raw[key] * k
        elif key.endswith("_s") or key == "stall_s_per_token":
            out[key] = raw[key] / k
    return out


def run_emulated(cfg) -> dict:
    """The throughput run of ``cfg`` (a ThroughputConfig with ``emulate``) on the emulated device."""
    from fate_edge.devices.emulate import dilated_link, reads_direct
    from fate_edge.devices.link import LinkSpec, ThrottledLink

    from fate_edge.runtime.engine import Engine
    from fate_edge.runtime.engine_config import EngineConfig

    store, budget = engine_store(cfg)
    prompts = bench_prompts(cfg.concurrency)
    facts, d1, db = calibrate_modes(cfg, store, prompts)
    kw = engine_kwargs(cfg)
    link = LinkSpec(**facts["device_link"])

    def engine(max_batch: int, k: float) -> Engine:
        dilated = dilated_link(link, k)
        direct = reads_direct(dilated, facts["expert_bytes"], facts["disk_direct_read_s"])
        return Engine(
            EngineConfig(store, budget, max_batch=max_batch, link=ThrottledLink(dilated), direct_io=direct, **kw)
        )

    with engine(1, d1.k) as alone, engine(cfg.concurrency, db.k) as batched:
        served = serve_both(alone, batched, prompts, cfg)
    raw, single, mean_batch = served.rounds, served.single, served.mean_batch
    a = device_equivalent(median_rounds(raw["alone"]), d1.k)
    bt = device_equivalent(median_rounds(raw["batched"]), db.k)
    one = device_equivalent(median_rounds(single), d1.k)
    return {
        "alone": a,
        "batched": bt,
        "single_request": one,
        "raw": {
            "alone": median_rounds(raw["alone"]),
            "batched": median_rounds(raw["batched"]),
            "single_request": median_rounds(single),
        },
        "rounds": raw,
        "mean_batch": mean_batch,
        "emulation": facts | {"alone": asdict(d1), "batched": asdict(db)},
        "ratios": {
            "tok_s_batched_over_alone": bt["tok_s"] / a["tok_s"],
            "token_p50_batched_over_single": bt["token_p50_s"] / one["token_p50_s"],
            "bytes_per_token_alone_over_batched": bytes_ratio(a["bytes_per_token"], bt["bytes_per_token"]),
        },
        "config": asdict(cfg) | {"store": str(store), "budget_bytes": budget},
        "host": host_note(),
    }
