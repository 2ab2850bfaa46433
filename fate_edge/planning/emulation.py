"""Device-faithful emulation of one model on one device (``fate-edge bench --emulate DEVICE``).

The model's side of :mod:`fate_edge.devices.emulate`: what one decode token reads and computes on the device
(resident weights at fp16, the top-k experts of each MoE layer at the streamed precision), what the same token
takes on this host (measured: the engine's own decode, less stall and blob decoding), and from the two the
dilation ``k`` and the device's link on this host's timeline. Reads then go through O_DIRECT where this disk
is faster than the dilated link, so a read costs this CPU what a DMA costs the device's: no page-cache copy.
Tokens/s measured under emulation x ``k`` is the device-equivalent figure; the raw figure is this host's.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fate_edge.devices.emulate import Roofline, device_roofline, dilated_link, dilation, reads_direct
from fate_edge.devices.link import LinkSpec, ThrottledLink
from fate_edge.devices.profile import load_profile
from fate_edge.planning.device_costs import TokenWork, decode_token_work, device_link, resolve_device


@dataclass
class Emulation:
    device: str  # the name asked for (alias or profile)
    profile: str
    roofline: Roofline
    work: TokenWork
    host_s_per_token: float  # this host's decode compute per token, measured
    device_s_per_token: float  # the device's, from the roofline
    k: float  # dilation: host / device
    link: LinkSpec  # the device's own link
    emulated: LinkSpec  # the link on this host's timeline (bandwidth / k, latency x k)
    direct_io: bool  # reads with O_DIRECT (no page-cache copy), else buffered from the page cache
    expert_bytes: int  # one expert at the streamed precision
    disk_read_s: float | None  # one O_DIRECT read of an expert on this disk, measured (median)
    host_probe: str  # what was measured for host_s_per_token

    def device_tps(self, raw_tps: float | None) -> float | None:
        """Device-equivalent tokens/s of a tokens/s measured here under this emulation."""
        return None if raw_tps is None else raw_tps * self.k

    @property
    def io_note(self) -> str:
        link_ms = 1e3 * self.emulated.transfer_time(self.expert_bytes)
        disk = "O_DIRECT unavailable" if self.disk_read_s is None else f"{1e3 * self.disk_read_s:.1f} ms direct"
        compare = f"one expert: {disk} on this disk vs {link_ms:.1f} ms on the dilated link"
        if self.direct_io:
            return f"O_DIRECT reads (as a DMA: no page-cache copy; {compare})"
        return (
            f"buffered reads from a warm page cache ({compare}): each read pays a memcpy on this host's CPU "
            "that a DMA would not"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "profile": self.profile,
            "roofline": dataclasses.asdict(self.roofline),
            "token_bytes": self.work.bytes,
            "token_flops": self.work.flops,
            "token_work": self.work.what,
            "host_s_per_token": self.host_s_per_token,
            "device_s_per_token": self.device_s_per_token,
            "dilation_k": self.k,
            "device_link": dataclasses.asdict(self.link),
            "emulated_link": dataclasses.asdict(self.emulated),
            "direct_io": self.direct_io,
            "expert_bytes": self.expert_bytes,
            "disk_direct_read_s": self.disk_read_s,
            "io": self.io_note,
            "host_probe": self.host_probe,
            "note": "raw = measured on this host with the dilated link; device-equivalent = raw x dilation_k",
        }


def disk_direct_read_s(store_dir: str | Path, n: int = 8, bits: int = 4) -> float | None:
    """Median seconds of one O_DIRECT read of an expert on this disk (over ``n``), or None without O_DIRECT."""
    nbytes, seconds, io = time_reads(store_dir, None, True, n, bits)
    return statistics.median(seconds) if io == "O_DIRECT" else None


def time_reads(
    store_dir: str | Path, link: LinkSpec | None, direct_io: bool, n: int = 8, bits: int = 4
) -> tuple[int, list[float], str]:
    """Read ``n`` experts one after another through the fetch engine: (bytes, seconds of each read, its I/O path
    note)."""
    from fate_edge.fetch.fetch_engine import BufferPool, FetchEngine, Priority
    from fate_edge.format.store import ExpertStore

    s = ExpertStore(store_dir)
    refs = [s.ref(layer, e, bits) for layer in s.index["moe_layers"][:2] for e in range(s.index["num_experts"])][:n]
    fe = FetchEngine(
        BufferPool(2, s.precisions[bits].slot_bytes),
        workers=1,
        link=ThrottledLink(link) if link else None,
        direct_io=direct_io,
    )
    try:
        nbytes, seconds = 0, []
        for ref in refs:
            t0 = time.perf_counter()
            req = fe.submit(ref, Priority.DEMAND)
            fe.wait(req)
            seconds.append(time.perf_counter() - t0)
            nbytes += ref.length
            fe.release(req)
        return nbytes, seconds, fe.direct_io_note
    finally:
        fe.close()


def host_token_seconds(
    store_dir: str | Path,
    token_ids: list[int],
    tokens: int = 8,
    workers: int = 2,
    bits: int = 4,
    resident_bits: int | None = None,
) -> tuple[float, str]:
    """This host's decode compute per token: the planner's probe of the real engine (LRU, every int4 expert
    fitting, O_DIRECT reads, resident weights held as ``resident_bits`` says), each token's time less its stall
    and blob decoding, median over tokens."""
    import torch

    from fate_edge import defaults
    from fate_edge.format.checkpoint_layout import DTYPES
    from fate_edge.format.store import ExpertStore
    from fate_edge.planning.host_costs import probe_engine
    from fate_edge.runtime.compute_dtype import resolve_dtype
    from fate_edge.runtime.policy import PRESETS

    store = ExpertStore(store_dir)
    n_experts = len(store.index["moe_layers"]) * store.index["num_experts"]
    slot = store.precisions[bits].slot_bytes
    # Every expert fits (up to 4 GB), so few reads run beside the timed compute.
    budget = min(n_experts * store.expert_bytes(bits), int(4e9)) + 4 * slot
    run = probe_engine(
        store_dir,
        budget,
        PRESETS["lru"],
        None,
        token_ids,
        DTYPES[str(resolve_dtype(defaults.DTYPE, "cpu"))],  # auto: the dtype a run here computes in
        tokens=tokens,
        workers=workers,
        resident_bits=resident_bits,
    )
    per_token = run.compute_s / max(1, run.tokens)
    held = "" if resident_bits is None else f", int{resident_bits} resident linears"
    what = (
        f"engine decode of {run.tokens} tokens after {len(token_ids)} prompt tokens, every int{bits} expert "
        f"fitting (LRU){held}, {torch.get_num_threads()} torch threads: median token time less stall and blob "
        "decode"
    )
    return per_token, what


@dataclass(frozen=True)
class StoreSide:
    """What emulating a store needs from the store and this disk, whatever the device: measured once."""

    work: TokenWork
    expert_bytes: int  # one expert at the streamed precision
    resident_bits: int | None  # how the runs hold their resident linears (None: the model's dtype, fp16 on a device)
    disk_read_s: float | None  # one O_DIRECT read of an expert on this disk (median), None without O_DIRECT


def store_side(store_dir: str | Path, bits: int = 4, resident_bits: int | None = None) -> StoreSide:
    """The store's figures; ``resident_bits``: the precision the runs hold resident linears at (8 or 4), which the
    device's roofline then reads too (a W4A16 decode), and the host's probe holds them at."""
    from fate_edge.format.store import ExpertStore

    return StoreSide(
        decode_token_work(store_dir, bits, resident_bits),
        ExpertStore(store_dir).expert_bytes(bits),
        resident_bits,
        disk_direct_read_s(store_dir, bits=bits),
    )


def calibrate(
    device: str,
    store_dir: str | Path,
    token_ids: list[int],
    tokens: int = 8,
    workers: int = 2,
    bits: int = 4,
    host_s_per_token: float | None = None,
    side: StoreSide | None = None,
) -> Emulation:
    """The emulation of ``store_dir`` on ``device``: host time measured (unless given), device time from the
    profile's roofline, k, the dilated link, and whether reads go O_DIRECT. ``side``: the store's figures, when
    already measured (several devices, one store)."""
    side = side or store_side(store_dir, bits)
    profile_name, kind = resolve_device(device)
    profile = load_profile(profile_name)
    roof = device_roofline(profile)
    if host_s_per_token is None:
        host_s_per_token, probe = host_token_seconds(store_dir, token_ids, tokens, workers, bits, side.resident_bits)
    else:
        probe = "given"
    dev_s = roof.time_s(side.work.bytes, side.work.flops)
    k = dilation(host_s_per_token, dev_s)
    link = device_link(profile_name, kind)
    emulated = dilated_link(link, k)
    return Emulation(
        device,
        profile.name,
        roof,
        side.work,
        host_s_per_token,
        dev_s,
        k,
        link,
        emulated,
        reads_direct(emulated, side.expert_bytes, side.disk_read_s),
        side.expert_bytes,
        side.disk_read_s,
        probe,
    )


def plan_emulated(
    store_dir: str | Path,
    budget: int,
    devices: list[str],
    token_ids: list[int],
    workers: int = 2,
    decode_tokens: int = 64,
    bits: int = 4,
    progress=None,
) -> dict[str, tuple]:
    """The planner on each device's timeline: this host's costs and a decode trace measured once (the planner's
    probes, O_DIRECT reads), each device's k from them, the costs scaled by 1 / k and simulated against the
    device's own link: the compute/link ratio is the device's. {device: (Emulation, Plan)}; a Plan's tokens/s
    are device-equivalent."""
    from fate_edge.format.store import ExpertStore
    from fate_edge.model.arch import load_config
    from fate_edge.planning.host_costs import measure_host_costs
    from fate_edge.planning.plan_presets import preset_candidates
    from fate_edge.planning.plan_trace import describe_store
    from fate_edge.planning.planner import plan, probe_error
    from fate_edge.planning.simulate import scale_costs

    # The first device's preset is probed too (ungated, on this host's disk): its stall differs from the LRU
    # probe's, and the two give compute as a function of stall (host_costs.stall_drag), a host property the scaled
    # costs keep for every device.
    costs, host_link, trace = measure_host_costs(
        store_dir,
        budget,
        None,
        token_ids,
        workers=workers,
        decode_tokens=decode_tokens,
        progress=progress,
        direct_io=True,
        preset=preset_candidates(devices[0], store_dir)[0] if devices else None,
    )
    assert trace is not None  # decode_tokens >= 1: the probe recorded its decode
    host_s = costs.layer_compute_s * len(load_config(store_dir).moe_layers)
    store = ExpertStore(store_dir)
    describe_store(trace, store)
    expert, slot = store.expert_bytes(bits), store.precisions[bits].slot_bytes
    margin = probe_error(trace, budget, expert, slot, host_link, costs)  # on the host's timeline, where measured
    side = store_side(store_dir, bits)
    out = {}
    for device in devices:
        em = calibrate(device, store_dir, token_ids, workers=workers, bits=bits, host_s_per_token=host_s, side=side)
        em.host_probe = "the planner's LRU probe (compute per MoE layer x MoE layers)"
        presets = preset_candidates(device, store_dir)  # the descent starts from the first, the device's row
        out[device] = (
            em,
            plan(
                trace,
                budget,
                expert,
                slot,
                em.link,
                scale_costs(costs, 1 / em.k),
                start=presets[0],
                presets=presets,
                margin=margin,
            ),
        )
    return out
