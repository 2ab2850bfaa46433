"""What the benchmark runs: presets, budgets, the emulated links with their sources, and quick mode."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

# Presets in table order. The two load-on-demand presets keep no cache: they ignore the budget and run once per link.
ALL_PRESETS = ["load-on-demand", "load-on-demand-int4", "lru", "activation-path", "fate", "fate-edge", "oracle"]
ALL_BUDGETS = [0.20, 0.35, 0.50, 0.75]
HEADLINE_BUDGET = 0.35
LABELS = {"load-on-demand": "load-on-demand (bf16)", "load-on-demand-int4": "load-on-demand (int4)"}


@dataclass(frozen=True)
class LinkChoice:
    key: str
    title: str
    profile: str | None  # device profile the figures come from (None: defined here or the raw disk)
    kind: str  # storage | host-link | sd-card | raw-disk | emulated
    source: str
    emulated: Any = None  # kind "emulated": the device's link dilated to this host (a LinkSpec)
    direct_io: bool | None = None  # read with O_DIRECT (None: only on the raw disk)
    dilation: float | None = None  # kind "emulated": k; device-equivalent tok/s = raw x k

    def spec(self):
        """The LinkSpec to throttle to (None for the raw disk)."""
        from fate_edge.devices.link import host_to_accelerator_link, storage_link
        from fate_edge.devices.profile import load_profile

        if self.kind == "emulated":
            return self.emulated
        if self.kind == "storage":
            return storage_link(load_profile(self.profile))
        if self.kind == "host-link":
            return host_to_accelerator_link(load_profile(self.profile))
        if self.kind == "sd-card":
            return SD_CARD_LINK
        return None

    @property
    def reads_direct(self) -> bool:
        return self.kind == "raw-disk" if self.direct_io is None else self.direct_io


def emulated_choice(emulation) -> LinkChoice:
    """The link of a ``--emulate`` run (a planning.emulation.Emulation), keyed ``emulated-<device>``."""
    em = emulation
    return LinkChoice(
        f"emulated-{em.device}",
        f"{em.profile} emulated (link dilated x{em.k:.3g})",
        em.profile,
        "emulated",
        f"devices/profiles/{em.profile}.toml {em.link.name} ({em.link.bandwidth_bytes_per_s / 1e9:.3g} GB/s, "
        f"{em.link.latency_s * 1e6:.0f} us) dilated by k = host {em.host_s_per_token * 1e3:.1f} ms / device "
        f"{em.device_s_per_token * 1e3:.2f} ms per token = {em.k:.3g} (roofline: {em.roofline.compute_unit}, "
        f"x{em.roofline.efficiency} efficiency); {em.io_note}",
        em.emulated,
        em.direct_io,
        em.k,
    )


def _sd_card_link():
    from fate_edge.devices.link import LinkSpec

    return LinkSpec("microSD (UHS-I SDR104, A2 card) on a Raspberry Pi 5", 90e6, 200e-6)


# devices/profiles/raspberry-pi-5-8gb.toml describes an NVMe on the M.2 HAT+ (0.45 GB/s), not a microSD card,
# so the SD-card-class link is defined here with its sources.
SD_CARD_LINK = _sd_card_link()
SD_CARD_SOURCE = (
    "defined in fate_edge_lab/bench/config.py: 90 MB/s sequential read = the UHS-I SDR104 bus limit of 104 MB/s "
    "(SD specification; Raspberry Pi 5 supports SDR104 per its product brief) less protocol overhead, assumed; "
    "200 us per request = 1/5,000 IOPS, the Raspberry Pi documentation's 4 KB random-read figure for its A2 "
    "microSD card on a Raspberry Pi 5 (SDR104)"
)


LINKS: dict[str, LinkChoice] = {
    "orin-nano-nvme": LinkChoice(
        "orin-nano-nvme",
        "Jetson Orin Nano 8GB NVMe",
        "jetson-orin-nano-8gb",
        "storage",
        "devices/profiles/jetson-orin-nano-8gb.toml: storage_read_gbps, storage_latency_us",
    ),
    "pi5-microsd": LinkChoice("pi5-microsd", "Raspberry Pi 5 microSD", None, "sd-card", SD_CARD_SOURCE),
    "pcie-rtx4060": LinkChoice(
        "pcie-rtx4060",
        "PCIe host->GPU (RTX 4060 Laptop)",
        "laptop-rtx4060-8gb",
        "host-link",
        "devices/profiles/laptop-rtx4060-8gb.toml: host_link_gbps (PCIe 4.0 x8 = 15.75 GB/s, the same "
        "bandwidth as PCIe 3.0 x16)",
    ),
    "raw-disk": LinkChoice(
        "raw-disk",
        "raw disk (O_DIRECT, page cache dropped)",
        None,
        "raw-disk",
        "this machine's disk, unthrottled: O_DIRECT reads, page cache dropped before every request where permitted",
    ),
}


@dataclass
class BenchConfig:
    model: str | None = None  # model directory or store; None: the inflated bundled model
    int4_expert_mb: float = 2.0  # inflation target when --model is not given
    presets: list[str] = field(default_factory=lambda: list(ALL_PRESETS))
    budgets: list[float] = field(default_factory=lambda: list(ALL_BUDGETS))
    links: list[str] = field(default_factory=lambda: list(LINKS))
    prompt_tokens: list[int] = field(default_factory=lambda: [128, 512])
    decode_tokens: int = 128
    runs: int = 3
    threads: int = 0  # torch threads; 0: os.cpu_count()
    fetch_workers: int = 2
    peers: bool = True
    gguf: str | None = None  # GGUF of the same checkpoint for the llama.cpp peer
    planner: bool = True  # run the planner hook when fate_edge.planning.planner exists
    drop_caches: bool = True  # raw-disk runs: drop the page cache before every request where permitted
    timeout_s: float = 3600.0  # per configuration subprocess
    time_limit_s: float | None = None  # whole run: configurations that would start later are dropped (listed)
    out_dir: str = "bench-out"
    json_path: str | None = None
    md_path: str | None = None
    plot_path: str | None = None  # tokens/s vs budget; the per-layer plot goes next to it (<stem>_layers.png)
    plots_dir: str | None = None  # where the plots go when plot_path is not given (default: next to the JSON)
    readme: str | None = None  # the file whose bench markers take the table (--results: docs/results/bench.md)
    quick: bool = False
    work_dir: str | None = None  # where the inflated model and its store live (default: the fate-edge cache)
    isolate: bool = True  # each run in a fresh process (per-run peak RSS); False: tests
    device: str = "cpu"  # cpu or cuda (any store runs on CUDA; the bench converts portable for it, see layout)
    command: str | None = None  # the command line that ran the benchmark, recorded in its outputs
    emulate: str | None = None  # device-faithful emulation of this device (planning/emulation.py) instead of links
    emulate_host_ms: float | None = None  # reuse a calibration: this host's decode compute per token (else measured)
    # fate-edge's resident linears (attention, dense MLPs, shared experts, lm_head) quantized at load, 8 or 4; None:
    # the store's dtype. Under --emulate the device's roofline reads them at that precision too.
    resident_bits: int | None = None

    @property
    def layout(self) -> str:
        """The store's int4 layout: on CUDA the portable one (its experts unpack straight into CUDA's kernel layout;
        torch's CPU layout also runs there, re-packed the same way), else convert's own choice for this CPU."""
        return "portable" if self.device.startswith("cuda") else "auto"

    def __post_init__(self) -> None:
        if not self.threads:
            self.threads = os.cpu_count() or 1


# What --quick drops, applied in this order; stated in the output and in docs/performance.md.
QUICK = {
    "links": ["orin-nano-nvme"],  # drops pi5-microsd, pcie-rtx4060 and raw-disk
    "prompt_tokens": [128],  # drops the 512-token prompt
    "decode_tokens": 64,  # from 128
    "runs": 3,  # kept: this shared host's speed drifts, so single runs would rank presets by luck
    "budgets": list(ALL_BUDGETS),  # kept, but the run stops starting configurations after time_limit_s
    "time_limit_s": 480.0,
}
QUICK_NOTE = (
    "--quick: only the Jetson Orin Nano NVMe link (the microSD, PCIe and raw-disk links are dropped), "
    "only the 128-token prompt (512 dropped), 64 decode tokens instead of 128 (medians of 3 runs kept), "
    "and a 480 s limit after which no configuration is started: the 35% budget (with "
    "load-on-demand) runs first, then the peers, then 75%, 20% and 50% while time is left; whatever the "
    "limit dropped is listed in the output. All presets are kept"
)


def apply_quick(cfg: BenchConfig, explicit: set[str]) -> None:
    cfg.quick = True
    for name, value in QUICK.items():
        if name not in explicit:
            setattr(cfg, name, list(value) if isinstance(value, list) else value)


def headline_budget(budgets: list[float]) -> float:
    """The budget of the headline table: the one nearest HEADLINE_BUDGET."""
    return min(budgets, key=lambda b: abs(b - HEADLINE_BUDGET))
