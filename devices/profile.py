"""``DeviceProfile``: the figures a cost model or a link emulator needs about one device.

Profiles are TOML files shipped in ``devices/profiles/`` (package data, found through
``importlib.resources``). Every figure a profile states must name its source in ``[sources]``:
a datasheet line, a spec-derived calculation, or a measurement, so results can say what they assume.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from fate_edge.errors import ProfileError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser lives in the 'tomli' package (a dependency there)
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        tomllib = None

GiB = 1 << 30


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    description: str
    ram_bytes: int  # host memory (on unified-memory devices: the memory CPU and GPU share)
    memory_bandwidth_gbps: float  # peak host DRAM bandwidth, GB/s
    storage_read_gbps: float  # sequential read of the storage experts are streamed from, GB/s
    storage_latency_us: float  # one small random read at queue depth 1, µs
    cpu_cores: int
    cpu_gflops_fp32: float  # peak: cores × clock × FLOP/cycle
    unified_memory: bool  # True: compute reads weights straight from RAM (Jetson, CPU-only hosts)
    host_link_gbps: float | None = None  # host → accelerator copy bandwidth (PCIe); None for unified memory
    accelerator_memory_bytes: int | None = None  # discrete GPU memory; None when unified or no GPU
    accelerator_bandwidth_gbps: float | None = None  # discrete GPU memory bandwidth, GB/s
    gpu_tflops_fp32: float | None = None  # peak CUDA-core fp32; None without a CUDA GPU
    gpu_tflops_fp16_tensor: float | None = None  # dense tensor-core fp16 (fp32 accumulate), when published
    roofline_efficiency: float | None = None  # share of the peaks a batch-1 decode achieves (devices/emulate.py)
    sources: dict[str, str] = field(default_factory=dict)  # figure name → where the number comes from

    @property
    def figures(self) -> dict[str, Any]:
        """Every stated numeric figure (None ones are not stated)."""
        skip = {"name", "description", "unified_memory", "sources"}
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in skip and getattr(self, f.name) is not None
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], origin: str = "<dict>") -> DeviceProfile:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ProfileError(f"{origin}: unknown keys {unknown}; known keys: {sorted(known)}")
        required = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [k for k in required if k not in d]
        if missing:
            raise ProfileError(f"{origin}: missing keys {missing}")
        profile = cls(**{**d, "sources": dict(d.get("sources", {}))})
        unsourced = sorted(set(profile.figures) - set(profile.sources))
        if unsourced:
            raise ProfileError(f"{origin}: figures without a [sources] entry: {unsourced}")
        eff = profile.roofline_efficiency
        if eff is not None and not 0 < eff <= 1:
            raise ProfileError(f"{origin}: roofline_efficiency is a share of the peaks, in (0, 1]; got {eff}")
        if profile.unified_memory and profile.host_link_gbps is not None:
            raise ProfileError(f"{origin}: unified_memory devices have no host link; drop host_link_gbps")
        if not profile.unified_memory and profile.host_link_gbps is None:
            raise ProfileError(f"{origin}: a discrete accelerator needs host_link_gbps")
        return profile


def _parse_toml(text: str, origin: str) -> dict[str, Any]:
    if tomllib is None:
        raise ProfileError(
            "reading device profiles needs a TOML parser: Python >= 3.11 has tomllib built in; "
            "on Python 3.10 install 'tomli' (pip install tomli)"
        )
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{origin}: invalid TOML ({exc})") from exc


def _profiles_dir():
    return resources.files(__package__) / "profiles"


def list_profiles() -> list[str]:
    """Names of the shipped profiles (file names without ``.toml``), sorted."""
    return sorted(p.name[: -len(".toml")] for p in _profiles_dir().iterdir() if p.name.endswith(".toml"))


def load_profile(name: str | Path) -> DeviceProfile:
    """A shipped profile by name (``jetson-orin-nano-8gb``) or any profile TOML file by path."""
    path = Path(name)
    if path.suffix == ".toml" and path.exists():
        text, origin = path.read_text(encoding="utf-8"), str(path)
    else:
        res = _profiles_dir() / f"{name}.toml"
        if not res.is_file():
            raise ProfileError(f"no device profile '{name}'; shipped profiles: {', '.join(list_profiles())}")
        text, origin = res.read_text(encoding="utf-8"), f"devices/profiles/{name}.toml"
    d = _parse_toml(text, origin)
    d.setdefault("name", path.stem)
    return DeviceProfile.from_dict(d, origin)
