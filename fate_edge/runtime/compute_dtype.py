"""``--dtype auto`` (the default): the compute dtype this hardware runs best.

CUDA (a Jetson Orin included): bfloat16 where the GPU computes it natively (``torch.cuda.is_bf16_supported``).
A CPU without bf16 instructions (AVX512-BF16 or AMX-BF16): float32, which it computes natively. A CPU with them:
measured, not assumed: the probe decodes with the bundled model in both dtypes (interleaved rounds, a few seconds,
once per host) and keeps the faster; the answer is cached beside the host's probed profile, keyed by the CPU,
its thread count and torch's version (an AMD EPYC Zen 4 with AVX512-BF16 decoded slower in bfloat16:
docs/performance.md#compute-dtype). ``FATE_EDGE_DTYPE`` overrides the probe (float32 or bfloat16).

The probe's model is the bundled one, 256 wide, where a token is mostly operator overhead; a store of int4 experts
at least :data:`WIDE` wide (every real model) is served in bfloat16 on such a CPU without probing: there the decode
row's steps are native bf16 calls and the activations half the bytes, and bfloat16 measured faster at that shape
where the bundled model's probe said float32 (docs/measured-choices.md). The same holds on an x86 CPU without bf16
instructions whose AVX2 runs fate-edge's native kernels (they widen bf16 with a shift and round it back themselves):
an AMD Zen 3 decoded such a store faster in bfloat16 than in float32 (docs/measured-choices.md).
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from fate_edge.native_build import cpu_flags

DTYPES = ("float32", "bfloat16")
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
NATIVE_KERNEL_FLAGS = ("avx2", "fma")  # the native int4 and decode-row kernels' floor (quant/native, model/native)
PROBE_ROUNDS = 3
PROBE_TOKENS = 24
WIDE = 1024  # hidden size from which a store's int4 experts are served in bfloat16 on a bf16 CPU, unprobed


def cpu_has_bf16(flags: set[str] | None = None) -> bool:
    return bool(set(CPU_BF16_FLAGS) & (cpu_flags() if flags is None else flags))


def cpu_runs_native_kernels(flags: set[str] | None = None) -> bool:
    """Whether fate-edge's own x86 kernels run here (AVX2 and FMA), bf16 rows included without bf16 instructions."""
    return set(NATIVE_KERNEL_FLAGS) <= (cpu_flags() if flags is None else flags)


def probe_path() -> Path:
    from fate_edge.app_dirs import cache_home

    return cache_home() / "compute-dtype.json"


def _cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _host_key() -> str:
    return f"{_cpu_model()}|{torch.get_num_threads()} threads|torch {torch.__version__}"


def probe_decode_speed() -> dict[str, float]:
    """Decode tokens/s of the bundled model's default store in each dtype, every expert in memory: interleaved
    rounds, medians. (The model and its generation loop, not an Engine: the engine resolves its dtype here.) On a
    thread of its own, as a load (runtime.load_threads): run on the caller's, its OpenMP helpers outlived it and
    made a batching engine's team the process's second."""
    from fate_edge.runtime.load_threads import in_own_thread

    return in_own_thread(_probe_decode_speed)


def _probe_decode_speed() -> dict[str, float]:
    from fate_edge.bundled import bundled_model_dir
    from fate_edge.format.converted_stores import ensure_store
    from fate_edge.runtime.generate import GenerateConfig, generate_from_model
    from fate_edge.runtime.loader import load_model
    from fate_edge.tokenizer import Tokenizer

    path = ensure_store(bundled_model_dir(), progress=False)
    models = {d: load_model(path, dtype=d) for d in DTYPES}
    try:
        tok = Tokenizer(path)
        ids = tok.encode("def expert_cache(budget, layers):\n    return")
        config = GenerateConfig(max_tokens=PROBE_TOKENS, ignore_eos=True)
        speeds: dict[str, list[float]] = {d: [] for d in DTYPES}
        for m in models.values():
            generate_from_model(m, tok, ids, GenerateConfig(max_tokens=4, ignore_eos=True))  # warm up
        for _ in range(PROBE_ROUNDS):
            for d, m in models.items():
                speeds[d].append(generate_from_model(m, tok, ids, config)[1].generation_tps)
    finally:
        for m in models.values():  # their fetch workers stop here, not at the interpreter's exit
            close = getattr(m.experts, "close", None)
            if close is not None:
                close()
    return {d: statistics.median(v) for d, v in speeds.items()}


def probed_cpu_dtype(probe: Callable[[], dict[str, float]] = probe_decode_speed, path: Path | None = None) -> str:
    """The faster dtype of this host's CPU, probed once and cached (bfloat16 only where it is not slower)."""
    path = path or probe_path()
    key = _host_key()
    try:
        cached = json.loads(path.read_text())
        if cached.get("host") == key and cached.get("dtype") in DTYPES:
            return str(cached["dtype"])
    except (OSError, ValueError):
        pass
    speeds = probe()
    dtype = "bfloat16" if speeds["bfloat16"] >= speeds["float32"] else "float32"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"host": key, "dtype": dtype, "decode_tok_s": speeds}, indent=1))
    except OSError:
        pass  # a read-only cache: probe again next time
    return dtype


def wide_int4_store(store: str | Path | None) -> bool:
    """Whether ``store`` (an expert store's folder) holds int4 experts of a model at least :data:`WIDE` wide."""
    if store is None:
        return False
    try:
        index = json.loads((Path(store) / "store.json").read_text())
        return int(index.get("hidden_size", 0)) >= WIDE and "4" in index.get("precisions", {})
    except (OSError, ValueError, TypeError, AttributeError):  # not a store (a model folder, a GGUF): the probe decides
        return False


def native_dtype(
    device: str,
    flags: set[str] | None = None,
    probe: Callable[[], str] = probed_cpu_dtype,
    store: str | Path | None = None,
) -> str:
    """The compute dtype ``--dtype auto`` resolves to on ``device`` (cpu, cuda, cuda:N), for ``store`` where known."""
    forced = os.environ.get("FATE_EDGE_DTYPE")
    if forced in DTYPES:
        return forced
    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
    have = cpu_flags() if flags is None else flags  # /proc/cpuinfo read once
    if wide_int4_store(store) and (cpu_has_bf16(have) or cpu_runs_native_kernels(have)):
        return "bfloat16"
    return probe() if cpu_has_bf16(have) else "float32"


def resolve_dtype(dtype: str | torch.dtype, device: str, store: str | Path | None = None) -> str | torch.dtype:
    """``dtype`` itself, or for "auto" the hardware's native one for ``store`` (:func:`native_dtype`)."""
    if isinstance(dtype, str) and dtype == "auto":
        return native_dtype(device, store=store)
    return dtype
