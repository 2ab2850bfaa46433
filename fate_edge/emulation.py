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
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fate_edge.devices.emulate import Roofline, device_roofline, dilated_link, dilation, reads_direct
from fate_edge.devices.link import LinkSpec, ThrottledLink, host_to_accelerator_link, storage_link
from fate_edge.devices.profile import load_profile

from .errors import ProfileError

# Short names for the devices issue 14 re-derives presets on, and the profiles and links they stand for: the
# link is the hop experts cross on that device (its NVMe on the Jetsons and the Pi, PCIe on the laptop GPU).
DEVICES: dict[str, tuple[str, str]] = {
    "orin-nano": ("jetson-orin-nano-8gb", "storage"),
    "orin-nx": ("jetson-orin-nx-16gb", "storage"),
    "agx-orin": ("jetson-agx-orin-64gb", "storage"),
    "rpi5": ("raspberry-pi-5-8gb", "storage"),
    "rtx4060": ("laptop-rtx4060-8gb", "host-link"),
}


@dataclass(frozen=True)
class TokenWork:
    """Weights one decode token reads and the FLOPs it does, on the device."""

    bytes: float
    flops: float
    what: str  # how they were counted

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes


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
        return (f"buffered reads from a warm page cache ({compare}): each read pays a memcpy on this host's CPU "
                "that a DMA would not")

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device, "profile": self.profile, "roofline": dataclasses.asdict(self.roofline),
            "token_bytes": self.work.bytes, "token_flops": self.work.flops, "token_work": self.work.what,
            "host_s_per_token": self.host_s_per_token, "device_s_per_token": self.device_s_per_token,
            "dilation_k": self.k, "device_link": dataclasses.asdict(self.link),
            "emulated_link": dataclasses.asdict(self.emulated), "direct_io": self.direct_io,
            "expert_bytes": self.expert_bytes, "disk_direct_read_s": self.disk_read_s,
            "io": self.io_note, "host_probe": self.host_probe,
            "note": "raw = measured on this host with the dilated link; device-equivalent = raw x dilation_k",
        }


def resolve_device(name: str) -> tuple[str, str]:
    """(profile name or TOML path, link kind) for a short name from DEVICES or a profile (its storage link)."""
    if name in DEVICES:
        return DEVICES[name]
    try:
        profile = load_profile(name)
    except ProfileError as exc:
        raise ProfileError(f"--emulate {name}: not a device; use one of {', '.join(DEVICES)} or a profile "
                           f"({exc})") from exc
    return name, "storage" if profile.unified_memory else "host-link"


def device_link(profile_name: str, kind: str) -> LinkSpec:
    profile = load_profile(profile_name)
    spec = host_to_accelerator_link(profile) if kind == "host-link" else storage_link(profile)
    assert spec is not None  # resolve_device picks host-link only for profiles that have one
    return spec


def decode_token_work(store_dir: str | Path, bits: int = 4, resident_bits: int | None = None) -> TokenWork:
    """What one decode token reads and computes on a device: every resident weight but the embedding table
    (one row is read; a tied table is read whole as the lm_head) and ``num_experts_per_tok`` experts of every MoE
    layer at int``bits``; 2 FLOPs per weight used. Resident weights count at fp16, or, with ``resident_bits`` (8
    or 4, as the run holds them), the linears the loader quantizes (attention, dense MLPs, shared experts, lm_head:
    :func:`fused.resident_groups`) at that precision with their fp16 scales (int4: a scale and a zero per group;
    int8: a scale per row) and the rest at fp16. Attention over the KV cache is left out (short contexts: a few
    MB)."""
    from .arch import load_config
    from .checkpoint import CheckpointReader
    from .fused import int4_group, resident_groups
    from .loader import layer_names
    from .prequantized import is_float_weight, stored_bits, stored_params
    from .store import ExpertStore

    if resident_bits not in (None, 8, 4):
        raise ValueError(f"resident_bits must be 8 or 4 (or None for fp16), not {resident_bits}")
    cfg = load_config(store_dir)
    store = ExpertStore(store_dir)
    reader = CheckpointReader(store_dir)
    names = [n for n in reader.keys() if not n.startswith("model.embed_tokens.") or cfg.tie_word_embeddings]
    quantized = set()
    if resident_bits is not None:
        groups = resident_groups(cfg, layer_names(cfg, reader), set(names))
        quantized = {f"{n}.weight" for group in groups for n in group}
    params, nbytes = 0, 0.0
    for name in names:
        shape = reader.shape(name)
        n = math.prod(shape)
        if not is_float_weight(name):  # quantized at convert (convert --resident-bits): read as stored
            params, nbytes = params + stored_params(name, n), nbytes + reader.nbytes(name)
            continue
        params += n
        group = int4_group(shape[-1]) if resident_bits == 4 else None
        if name not in quantized:
            nbytes += 2 * n
        elif group is not None:  # group-wise int4: an fp16 scale and zero per group of the input dimension
            nbytes += n / 2 + 4 * n / group
        else:  # per-row int8 (asked for, or an int4 width no group divides): one fp16 scale per output row
            nbytes += n + 2 * shape[0]
    experts = len(cfg.moe_layers) * cfg.num_experts_per_tok
    nbytes += experts * store.expert_bytes(bits)
    flops = 2 * (params + experts * cfg.expert_params)
    resident_bits = resident_bits or stored_bits(reader)[0]
    held = "fp16" if resident_bits is None else f"int{resident_bits} linears (the rest fp16)"
    what = (f"{params / 1e6:.1f} M resident params at {held} + {experts} experts per token "
            f"({len(cfg.moe_layers)} MoE layers x top-{cfg.num_experts_per_tok}) at int{bits}")
    return TokenWork(float(nbytes), float(flops), what)


def read_layers(store_dir: str | Path, device: str, bits: int = 4, resident_bits: int | None = None) -> float:
    """One int``bits`` expert read over ``device``'s link, in MoE layers of the device's decode compute for this
    store's model (the roofline's token time over the MoE layers; resident linears at ``resident_bits``). A few
    layers or less, a read ahead hides behind the layers it runs beside; many more, decode is link-bound
    (device_presets.HIDING_READ_LAYERS picks the row by it)."""
    from .arch import load_config
    from .store import ExpertStore

    profile_name, kind = resolve_device(device)
    work = decode_token_work(store_dir, bits, resident_bits)
    layer_s = device_roofline(load_profile(profile_name)).time_s(work.bytes, work.flops) / len(
        load_config(store_dir).moe_layers)
    return device_link(profile_name, kind).transfer_time(ExpertStore(store_dir).expert_bytes(bits)) / layer_s


def disk_direct_read_s(store_dir: str | Path, n: int = 8, bits: int = 4) -> float | None:
    """Median seconds of one O_DIRECT read of an expert on this disk (over ``n``), or None without O_DIRECT."""
    nbytes, seconds, io = time_reads(store_dir, None, True, n, bits)
    return statistics.median(seconds) if io == "O_DIRECT" else None


def time_reads(store_dir: str | Path, link: LinkSpec | None, direct_io: bool, n: int = 8, bits: int = 4
               ) -> tuple[int, list[float], str]:
    """Read ``n`` experts one after another through the fetch engine: (bytes, seconds of each read, its I/O path
    note)."""
    from .fetch import BufferPool, FetchEngine, Priority
    from .store import ExpertStore

    s = ExpertStore(store_dir)
    refs = [s.ref(layer, e, bits) for layer in s.index["moe_layers"][:2] for e in range(s.index["num_experts"])][:n]
    fe = FetchEngine(BufferPool(2, s.precisions[bits].slot_bytes), workers=1,
                     link=ThrottledLink(link) if link else None, direct_io=direct_io)
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


def host_token_seconds(store_dir: str | Path, token_ids: list[int], tokens: int = 8, workers: int = 2,
                       bits: int = 4, resident_bits: int | None = None) -> tuple[float, str]:
    """This host's decode compute per token: the planner's probe of the real engine (LRU, every int4 expert
    fitting, O_DIRECT reads, resident weights held as ``resident_bits`` says), each token's time less its stall
    and blob decoding, median over tokens."""
    import torch

    from . import defaults
    from .loader import DTYPES
    from .planner import probe_engine
    from .policy import PRESETS
    from .store import ExpertStore

    store = ExpertStore(store_dir)
    n_experts = len(store.index["moe_layers"]) * store.index["num_experts"]
    slot = store.precisions[bits].slot_bytes
    # Every expert fits (up to 4 GB), so few reads run beside the timed compute.
    budget = min(n_experts * store.expert_bytes(bits), int(4e9)) + 4 * slot
    run = probe_engine(store_dir, budget, PRESETS["lru"], None, token_ids, DTYPES[defaults.DTYPE], tokens=tokens,
                       workers=workers, resident_bits=resident_bits)
    per_token = run.compute_s / max(1, run.tokens)
    held = "" if resident_bits is None else f", int{resident_bits} resident linears"
    what = (f"engine decode of {run.tokens} tokens after {len(token_ids)} prompt tokens, every int{bits} expert "
            f"fitting (LRU){held}, {torch.get_num_threads()} torch threads: median token time less stall and blob "
            "decode")
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
    from .store import ExpertStore

    return StoreSide(decode_token_work(store_dir, bits, resident_bits), ExpertStore(store_dir).expert_bytes(bits),
                     resident_bits, disk_direct_read_s(store_dir, bits=bits))


def calibrate(device: str, store_dir: str | Path, token_ids: list[int], tokens: int = 8, workers: int = 2,
              bits: int = 4, host_s_per_token: float | None = None, side: StoreSide | None = None) -> Emulation:
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
    return Emulation(device, profile.name, roof, side.work, host_s_per_token, dev_s, k, link, emulated,
                     reads_direct(emulated, side.expert_bytes, side.disk_read_s), side.expert_bytes,
                     side.disk_read_s, probe)


def plan_emulated(store_dir: str | Path, budget: int, devices: list[str], token_ids: list[int],
                  workers: int = 2, decode_tokens: int = 64, bits: int = 4, progress=None) -> dict[str, tuple]:
    """The planner on each device's timeline: this host's costs and a decode trace measured once (the planner's
    probes, O_DIRECT reads), each device's k from them, the costs scaled by 1 / k and simulated against the
    device's own link: the compute/link ratio is the device's. {device: (Emulation, Plan)}; a Plan's tokens/s
    are device-equivalent."""
    from .arch import load_config
    from .plan_presets import preset_candidates
    from .planner import describe_store, measure_host_costs, plan, probe_error
    from .simulate import scale_costs
    from .store import ExpertStore

    costs, host_link, trace = measure_host_costs(store_dir, budget, None, token_ids, workers=workers,
                                                 decode_tokens=decode_tokens, progress=progress, direct_io=True)
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
        out[device] = (em, plan(trace, budget, expert, slot, em.link, scale_costs(costs, 1 / em.k),
                                start=presets[0], presets=presets, margin=margin))
    return out
