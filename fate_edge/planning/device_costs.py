"""A device's side of emulation and of its presets: the short device names, what one decode token reads and
computes there, and how many MoE layers of its compute one expert read costs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from fate_edge.devices.emulate import device_roofline
from fate_edge.devices.link import LinkSpec, host_to_accelerator_link, storage_link
from fate_edge.devices.profile import load_profile
from fate_edge.errors import ProfileError

# Short names for the devices presets are derived on, and the profiles and links they stand for: the link is the
# hop experts cross on that device (its NVMe on the Jetsons and the Pi, PCIe on the laptop GPU).
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


def resolve_device(name: str) -> tuple[str, str]:
    """(profile name or TOML path, link kind) for a short name from DEVICES or a profile (its storage link)."""
    if name in DEVICES:
        return DEVICES[name]
    try:
        profile = load_profile(name)
    except ProfileError as exc:
        raise ProfileError(
            f"--emulate {name}: not a device; use one of {', '.join(DEVICES)} or a profile ({exc})"
        ) from exc
    return name, "storage" if profile.unified_memory else "host-link"


def device_link(profile: str, kind: str) -> LinkSpec:
    loaded = load_profile(profile)
    spec = host_to_accelerator_link(loaded) if kind == "host-link" else storage_link(loaded)
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
    from fate_edge.format.checkpoint import CheckpointReader
    from fate_edge.format.checkpoint_layout import layer_names
    from fate_edge.format.prequantized import is_float_weight, stored_bits, stored_params
    from fate_edge.format.store import ExpertStore
    from fate_edge.model.arch import load_config
    from fate_edge.model.layer import int4_group, resident_groups

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
    what = (
        f"{params / 1e6:.1f} M resident params at {held} + {experts} experts per token "
        f"({len(cfg.moe_layers)} MoE layers x top-{cfg.num_experts_per_tok}) at int{bits}"
    )
    return TokenWork(float(nbytes), float(flops), what)


def read_layers(store_dir: str | Path, device: str, bits: int = 4, resident_bits: int | None = None) -> float:
    """One int``bits`` expert read over ``device``'s link, in MoE layers of the device's decode compute for this
    store's model (the roofline's token time over the MoE layers; resident linears at ``resident_bits``). A few
    layers or less, a read ahead hides behind the layers it runs beside; many more, decode is link-bound
    (device_presets.HIDING_READ_LAYERS picks the row by it)."""
    from fate_edge.format.store import ExpertStore
    from fate_edge.model.arch import load_config

    profile, kind = resolve_device(device)
    work = decode_token_work(store_dir, bits, resident_bits)
    layer_s = device_roofline(load_profile(profile)).time_s(work.bytes, work.flops) / len(
        load_config(store_dir).moe_layers
    )
    return device_link(profile, kind).transfer_time(ExpertStore(store_dir).expert_bytes(bits)) / layer_s
