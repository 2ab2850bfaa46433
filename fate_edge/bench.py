"""The side-by-side benchmark (DESIGN §8): every baseline preset and ours, in one run, as ratios.

For each emulated link (device profiles' storage or host link, plus the raw disk), each preset and each
memory budget (a share of the int4 expert bytes), one fresh subprocess runs the same requests ``--runs``
times on a cold engine and reports medians: prefill tokens/s per prompt length, decode tokens/s, stall
time and bytes read per decode token, hit rate (cache + timely prefetch), prediction exact match, a
per-layer hit breakdown, and the process's peak RSS (VmHWM, so it is per configuration). Ratios to
load-on-demand (bf16 and int4), to ``fate`` and to the ``oracle`` come from the same run. Peers
(transformers + accelerate disk offload, llama.cpp through llama-cpp-python) run beside them when
installed. Outputs: JSON, a markdown table (optionally spliced into README.md) and PNG plots.

    python scripts/bench.py --quick --readme README.md      # or: fate-edge bench --quick --readme README.md

Model: by default the bundled model inflated to realistic expert sizes (scripts/make_inflated_model.py,
~2 MB per int4 expert) and converted once into a store with int4, int2 (cold) and bf16 copies, kept
under the fate-edge cache directory; ``--model`` takes another model directory or store.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import gc
import hashlib
import importlib.util
import itertools
import json
import os
import pickle
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .report import markers, replace_between_markers

REPO_ROOT = Path(__file__).resolve().parents[1]
README_BEGIN, README_END = markers("bench")

# Presets in table order. The two load-on-demand presets keep no cache: they ignore the budget and run once per link.
ALL_PRESETS = ["load-on-demand", "load-on-demand-int4", "lru", "activation-path", "fate", "fate-edge", "oracle"]
ALL_BUDGETS = [0.20, 0.35, 0.50, 0.75]
HEADLINE_BUDGET = 0.35
LABELS = {"load-on-demand": "load-on-demand (bf16)", "load-on-demand-int4": "load-on-demand (int4)"}


# ------------------------------------------------------------------------------------------------ links
@dataclass(frozen=True)
class LinkChoice:
    key: str
    title: str
    profile: str | None  # device profile the figures come from (None: defined here or the raw disk)
    kind: str  # storage | host-link | sd-card | raw-disk
    source: str

    def spec(self):
        """The LinkSpec to throttle to (None for the raw disk)."""
        from fate_edge.devices.link import host_to_accelerator_link, storage_link
        from fate_edge.devices.profile import load_profile

        if self.kind == "storage":
            return storage_link(load_profile(self.profile))
        if self.kind == "host-link":
            return host_to_accelerator_link(load_profile(self.profile))
        if self.kind == "sd-card":
            return SD_CARD_LINK
        return None


def _sd_card_link():
    from fate_edge.devices.link import LinkSpec

    return LinkSpec("microSD (UHS-I SDR104, A2 card) on a Raspberry Pi 5", 90e6, 200e-6)


# devices/profiles/raspberry-pi-5-8gb.toml describes an NVMe on the M.2 HAT+ (0.45 GB/s), not a microSD card,
# so the SD-card-class link is defined here with its sources.
SD_CARD_LINK = _sd_card_link()
SD_CARD_SOURCE = (
    "defined in fate_edge/bench.py: 90 MB/s sequential read = the UHS-I SDR104 bus limit of 104 MB/s "
    "(SD specification; Raspberry Pi 5 supports SDR104 per its product brief) less protocol overhead, assumed; "
    "200 us per request = 1/5,000 IOPS, the Raspberry Pi documentation's 4 KB random-read figure for its A2 "
    "microSD card on a Raspberry Pi 5 (SDR104)")

LINKS: dict[str, LinkChoice] = {
    "orin-nano-nvme": LinkChoice(
        "orin-nano-nvme", "Jetson Orin Nano 8GB NVMe", "jetson-orin-nano-8gb", "storage",
        "devices/profiles/jetson-orin-nano-8gb.toml: storage_read_gbps, storage_latency_us"),
    "pi5-microsd": LinkChoice("pi5-microsd", "Raspberry Pi 5 microSD", None, "sd-card", SD_CARD_SOURCE),
    "pcie-rtx4060": LinkChoice(
        "pcie-rtx4060", "PCIe host->GPU (RTX 4060 Laptop)", "laptop-rtx4060-8gb", "host-link",
        "devices/profiles/laptop-rtx4060-8gb.toml: host_link_gbps (PCIe 4.0 x8 = 15.75 GB/s, the same "
        "bandwidth as PCIe 3.0 x16)"),
    "raw-disk": LinkChoice(
        "raw-disk", "raw disk (O_DIRECT, page cache dropped)", None, "raw-disk",
        "this machine's disk, unthrottled: O_DIRECT reads, page cache dropped before every request where permitted"),
}


# ------------------------------------------------------------------------------------------------ config
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
    planner: bool = True  # run the planner hook when fate_edge.planner exists
    drop_caches: bool = True  # raw-disk runs: drop the page cache before every request where permitted
    timeout_s: float = 3600.0  # per configuration subprocess
    time_limit_s: float | None = None  # whole run: configurations that would start later are dropped (listed)
    out_dir: str = "bench-out"
    json_path: str | None = None
    md_path: str | None = None
    plot_path: str | None = None  # tokens/s vs budget; the per-layer plot goes next to it (<stem>_layers.png)
    readme: str | None = None
    quick: bool = False
    work_dir: str | None = None  # where the inflated model and its store live (default: the fate-edge cache)
    isolate: bool = True  # each run in a fresh process (per-run peak RSS); False: tests
    device: str = "cpu"  # cpu or cuda (the CUDA path needs the portable blob layout)

    @property
    def layout(self) -> str:
        return "portable" if self.device.startswith("cuda") else "auto"

    def __post_init__(self) -> None:
        if not self.threads:
            self.threads = os.cpu_count() or 1


# What --quick drops, applied in this order; stated in the output and the README.
QUICK = {
    "links": ["orin-nano-nvme"],  # drops pi5-microsd, pcie-rtx4060 and raw-disk
    "prompt_tokens": [128],  # drops the 512-token prompt
    "decode_tokens": 64,  # from 128
    "runs": 3,  # kept: this shared host's speed drifts, so single runs would rank presets by luck
    "budgets": list(ALL_BUDGETS),  # kept, but the run stops starting configurations after time_limit_s
    "time_limit_s": 480.0,
}
QUICK_NOTE = ("--quick: only the Jetson Orin Nano NVMe link (the microSD, PCIe and raw-disk links are dropped), "
              "only the 128-token prompt (512 dropped), 64 decode tokens instead of 128 (medians of 3 runs kept), "
              "and a 480 s limit after which no configuration is started: the 35% budget (with "
              "load-on-demand) runs first, then the peers, then 75%, 20% and 50% while time is left; whatever the "
              "limit dropped is listed in the output. All presets are kept")


def apply_quick(cfg: BenchConfig, explicit: set[str]) -> None:
    cfg.quick = True
    for name, value in QUICK.items():
        if name not in explicit:
            setattr(cfg, name, list(value) if isinstance(value, list) else value)


# ------------------------------------------------------------------------------------------------ model
def _load_script(name: str):
    """A module from scripts/ (present in a source checkout, not in a wheel), or None."""
    path = REPO_ROOT / "scripts" / f"{name}.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location(f"_fate_bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def default_work_dir() -> Path:
    from .store_cache import cache_root

    return cache_root().parent / "bench"


def _fingerprint(model_dir: Path, extra: str) -> str:
    h = hashlib.sha256(str(model_dir.resolve()).encode() + extra.encode())
    for f in sorted(model_dir.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


def _convert_once(model_dir: Path, out: Path, layout: str = "auto") -> Path:
    from .convert import ConvertOptions, convert
    from .store import is_store

    if layout != "auto":
        out = out.with_name(f"{out.name}-{layout}")
    if not is_store(out):
        print(f"bench: converting {model_dir} -> {out} (int4 + int2 cold copy + bf16)", flush=True)
        convert(model_dir, out, ConvertOptions(bits=4, cold_bits=2, keep_bf16=True, layout=layout), progress=False)
        # Flush the new files to disk now, so their writeback does not take CPU from the first measurements.
        os.sync()
    return out


def prepare_model(cfg: BenchConfig) -> tuple[Path, Path | None, str]:
    """(store, Hugging Face checkpoint or None, description). Built once and reused from the work dir."""
    from .bundled import bundled_model_dir
    from .store import is_store

    work = Path(cfg.work_dir) if cfg.work_dir else default_work_dir()
    if cfg.model:
        src = Path(cfg.model)
        if is_store(src):
            return src, None, f"store {src}"
        store = _convert_once(src, work / f"{src.name}-store-{_fingerprint(src, 'store')}", cfg.layout)
        return store, src, f"{src}"
    bundled = bundled_model_dir()
    mk = _load_script("make_inflated_model")
    if mk is None:
        print("bench: scripts/make_inflated_model.py not found (not a source checkout); using the bundled model "
              "as is, whose experts are tiny", flush=True)
        store = _convert_once(bundled, work / f"tiny-moe-store-{_fingerprint(bundled, 'store')}", cfg.layout)
        return store, bundled, "bundled tiny-moe (not inflated)"
    hidden = json.loads((bundled / "config.json").read_text())["hidden_size"]
    inter = mk.inflated_size(hidden, cfg.int4_expert_mb)
    tag = _fingerprint(bundled, f"inflate-{inter}")
    model_dir = work / f"tiny-moe-inflated-{inter}-{tag}"
    if not (model_dir / "config.json").exists():
        print(f"bench: inflating the bundled model to expert intermediate size {inter} -> {model_dir}", flush=True)
        tmp = model_dir.parent / f".{model_dir.name}.partial-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        mk.inflate(bundled, tmp, inter)
        tmp.rename(model_dir)
    store = _convert_once(model_dir, work / f"{model_dir.name}-store", cfg.layout)
    return store, model_dir, f"bundled tiny-moe inflated to expert intermediate size {inter} (inert units)"


def store_info(store: Path) -> dict[str, Any]:
    from .arch import load_config
    from .store import ExpertStore

    s = ExpertStore(store)
    cfg = load_config(store)
    n = len(s.index["moe_layers"]) * s.index["num_experts"]
    return {
        "path": str(store),
        "moe_layers": len(s.index["moe_layers"]),
        "num_experts": s.index["num_experts"],
        "experts_per_token": cfg.num_experts_per_tok,
        "hidden_size": s.index["hidden_size"],
        "moe_intermediate_size": s.index["moe_intermediate_size"],
        "expert_bytes": {str(b): s.expert_bytes(b) for b in s.bits_available},
        "int4_expert_bytes_total": n * s.expert_bytes(4),
        "resident_bytes": (store / "resident.safetensors").stat().st_size,
    }


# ------------------------------------------------------------------------------------------------ prompts
def _is_heldout(path: Path, fraction: float) -> bool:
    # The held-out rule of scripts/train_tiny_moe.py (is_heldout), which trained the bundled model.
    digest = hashlib.sha1(path.name.encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < fraction


def heldout_source(min_chars: int, fraction: float = 0.02) -> tuple[str, list[str]]:
    """Python source the bundled model never trained on: the stdlib files its training run held out."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and _is_heldout(p, fraction))
    texts, used = [], []
    for p in files:
        try:
            texts.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        used.append(str(p.relative_to(root)))
        if sum(map(len, texts)) >= min_chars:
            break
    if not texts:  # no stdlib sources (embedded Python): fall back to this file
        texts, used = [Path(__file__).read_text(encoding="utf-8")], [Path(__file__).name]
    return "\n\n".join(texts), used


def make_prompts(store: Path, lengths: list[int]) -> tuple[dict[int, list[int]], list[str]]:
    from .tokenizer import Tokenizer

    tok = Tokenizer(store)
    need = max(lengths)
    chars = need * 8
    while True:
        text, files = heldout_source(chars)
        ids = tok.encode(text)
        if len(ids) >= need or chars > need * 64:
            break
        chars *= 2
    while len(ids) < need:  # tiny stdlib: repeat the text
        ids = ids + ids
    return {n: ids[:n] for n in lengths}, files


# ------------------------------------------------------------------------------------------------ worker side
def drop_page_cache() -> tuple[bool, str]:
    """sync + echo 3 > /proc/sys/vm/drop_caches; (worked, note)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True, "page cache dropped (echo 3 > /proc/sys/vm/drop_caches)"
    except OSError as exc:
        return False, f"could not drop the page cache ({exc.strerror or exc}); reads may hit it"


def warm_page_cache(store: Path) -> None:
    """Read the expert files once so emulated links measure the link, not this machine's disk."""
    for f in sorted(store.glob("experts-*.bin")):
        with open(f, "rb") as fh:
            while fh.read(16 << 20):
                pass


class LayerCounter:
    """Routing observer run before the scheduler's: was each routed expert cached, in flight, or a miss?"""

    def __init__(self, engine):
        self.engine = engine
        self.counts: dict[str, dict[int, list[int]]] = {"prefill": {}, "decode": {}}

    def __call__(self, layer, h, idx, weights) -> None:
        phase = "prefill" if h.shape[0] > 1 else "decode"
        c = self.counts[phase].setdefault(layer, [0, 0, 0])  # cached, prefetched (issued earlier), missed
        cache, pending = self.engine.cache, self.engine.scheduler.prefetches
        for e in idx.flatten().unique().tolist():
            key = (layer, e)
            if cache is not None and key in cache:
                c[0] += 1
            elif key in pending:
                c[1] += 1
            else:
                c[2] += 1


def _stats_dict(s) -> dict[str, Any]:
    d = dataclasses.asdict(s)
    d.update(uses=s.uses, hit_rate=s.hit_rate, exact_match=s.exact_match, recall=s.recall)
    return d


def _sum_stats(items):
    from .scheduler import SchedulerStats

    total = SchedulerStats()
    for s in items:
        for f in dataclasses.fields(total):
            setattr(total, f.name, getattr(total, f.name) + getattr(s, f.name))
    return total


def _one_request(spec: dict, ids: list[int], max_tokens: int, trace, counter_sink: dict) -> dict[str, Any]:
    from fate_edge.devices.link import LinkSpec, ThrottledLink

    from .engine import Engine
    from .generate import GenerateConfig

    link = ThrottledLink(LinkSpec(**spec["link_spec"])) if spec["link_spec"] else None
    dropped = None
    if spec["link"] == "raw-disk" and spec["drop_caches"]:
        dropped = drop_page_cache()
    policy = spec["preset"]
    if spec.get("policy"):  # a PolicyConfig given as data (the planner's choice)
        from .policy import PolicyConfig

        policy = PolicyConfig(**spec["policy"])
    # Emulated link: buffered reads from the warm page cache, throttled to the link. (O_DIRECT would read
    # at this disk's speed first, which is slower than the NVMe and PCIe links emulated.)
    engine = Engine(spec["store"], spec["budget_bytes"], policy, link=link, trace=trace,
                    workers=spec["fetch_workers"], device=spec.get("device", "cpu"), direct_io=link is None)
    counter = LayerCounter(engine)
    counter_counts = counter.counts
    engine.model.observers.insert(0, counter)
    try:
        times, tokens, last = [], [], None
        for last in engine.stream(ids, GenerateConfig(max_tokens=max_tokens, ignore_eos=True)):
            times.append(time.perf_counter())
            tokens.append(last.token)
        assert last is not None
        decode = _sum_stats(engine.token_stats)
        n_dec = len(engine.token_stats)
        out = {
            "prompt_tokens": len(ids),
            "prefill_tps": last.prompt_tps,
            "prefill": _stats_dict(engine.prefill_stats),
            "decode_tokens": n_dec,
            "decode_tps": n_dec / (times[-1] - times[0]) if n_dec and times[-1] > times[0] else None,
            "decode": _stats_dict(decode),
            "tokens": tokens,
            "direct_io": engine.fetch.direct_io_note,
            "page_cache": None if dropped is None else {"dropped": dropped[0], "note": dropped[1]},
            "plan": {"cache_bytes": engine.plan.cache_bytes, "pool_bytes": engine.plan.pool_bytes,
                     "entry_bytes": engine.plan.entry_bytes,
                     "slots": {str(k): v for k, v in engine.plan.slots.items()}},
        }
    finally:
        engine.close()
        del engine, counter
        gc.collect()  # the next request's cold engine starts from this one's memory returned
    for phase, layers in counter_counts.items():
        if phase == "decode" and max_tokens < 2:
            continue
        dst = counter_sink.setdefault(phase, {})
        for layer, c in layers.items():
            acc = dst.setdefault(str(layer), [0, 0, 0])
            for i in range(3):
                acc[i] += c[i]
    return out


def _median(values):
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarize_runs(runs: list[dict], decode_len: int) -> dict[str, Any]:
    """Medians over runs of the headline numbers."""
    med: dict[str, Any] = {"prefill_tps": {}, "prefill_hit_rate": {}, "prefill_stall_s": {}, "prefill_mb": {},
                           "prefill_low_precision": {}}
    for n in sorted({int(k) for r in runs for k in r["requests"]}):
        reqs = [r["requests"][str(n)] for r in runs]
        med["prefill_tps"][str(n)] = _median(q["prefill_tps"] for q in reqs)
        med["prefill_hit_rate"][str(n)] = _median(q["prefill"]["hit_rate"] for q in reqs)
        med["prefill_stall_s"][str(n)] = _median(q["prefill"]["stall_s"] for q in reqs)
        med["prefill_mb"][str(n)] = _median(
            (q["prefill"]["demand_bytes"] + q["prefill"]["prefetch_bytes"] + q["prefill"]["wasted_bytes"]) / 1e6
            for q in reqs)
        med["prefill_low_precision"][str(n)] = _median(q["prefill"]["low_precision"] for q in reqs)
    dec = [r["requests"][str(decode_len)] for r in runs]

    def per_tok(q, key):
        return q["decode"][key] / q["decode_tokens"] if q["decode_tokens"] else None

    med["decode_tps"] = _median(q["decode_tps"] for q in dec)
    med["stall_ms_per_token"] = _median(1e3 * per_tok(q, "stall_s") if q["decode_tokens"] else None for q in dec)
    med["mb_read_per_token"] = _median(
        (q["decode"]["demand_bytes"] + q["decode"]["prefetch_bytes"] + q["decode"]["wasted_bytes"])
        / q["decode_tokens"] / 1e6 if q["decode_tokens"] else None for q in dec)
    med["demand_mb_per_token"] = _median(per_tok(q, "demand_bytes") / 1e6 if q["decode_tokens"] else None
                                         for q in dec)
    med["wasted_mb_per_token"] = _median(per_tok(q, "wasted_bytes") / 1e6 if q["decode_tokens"] else None
                                         for q in dec)
    med["misses_per_token"] = _median(per_tok(q, "misses") for q in dec)
    med["hit_rate"] = _median(q["decode"]["hit_rate"] for q in dec)
    med["exact_match"] = _median(q["decode"]["exact_match"] if q["decode"]["predictions"] else None for q in dec)
    med["recall"] = _median(q["decode"]["recall"] if q["decode"]["predictions"] else None for q in dec)
    return med


def merge_runs(parts: list[dict], decode_len: int) -> dict[str, Any]:
    """One configuration's result from its per-round worker results (one run each)."""
    out = dict(parts[0])
    out["runs"] = [run for p in parts for run in p["runs"]]
    out["median"] = summarize_runs(out["runs"], decode_len)
    out["peak_rss_bytes"] = max(p["peak_rss_bytes"] for p in parts)
    out["wall_s"] = sum(p["wall_s"] for p in parts)
    layers: dict[str, dict[str, list[int]]] = {}
    for p in parts:
        for phase, per_layer in p["per_layer"].items():
            for layer, counts in per_layer.items():
                acc = layers.setdefault(phase, {}).setdefault(layer, [0, 0, 0])
                for j, v in enumerate(counts):
                    acc[j] += v
    out["per_layer"] = layers
    for p, run in zip(parts, out["runs"]):  # one run per part: same greedy tokens as the first part's?
        for q in run["requests"].values():
            q["tokens_equal_first_run"] = p["tokens"] == parts[0]["tokens"]
    predicted = [p["planner_predicted_decode_tps"] for p in parts if p.get("planner_predicted_decode_tps")]
    if predicted:  # the planner ran in every round's worker: its median prediction, and every choice it made
        out["planner_predicted_decode_tps"] = statistics.median(predicted)
        out["planner_predictions"] = predicted
        out["planner_policies"] = [p["policy"] for p in parts]
    return out


def verify_store(spec: dict) -> None:
    """Check the CRC of every blob at the precisions this configuration reads (see fetch.py: verify once)."""
    from .policy import PolicyConfig, get_policy
    from .store import ExpertStore

    policy = PolicyConfig(**spec["policy"]) if spec.get("policy") else get_policy(spec["preset"])
    store = ExpertStore(spec["store"])
    store.verify([b for b in (policy.bits, policy.cold_bits) if b in store.precisions])


def worker_main(spec_path: str) -> int:
    """Run one configuration (``spec_path``: JSON written by the parent); write ``<spec>.result.json``."""
    import torch

    from .generate import peak_rss_bytes

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    t0 = time.perf_counter()
    traces = {}
    if spec["trace_file"]:
        with open(spec["trace_file"], "rb") as f:
            traces = pickle.load(f)["traces"]
    prompts = {int(k): v for k, v in spec["prompts"].items()}
    decode_len = min(prompts)
    trace = traces.get(decode_len) if spec["preset"] == "oracle" else None
    planned = plan_in_worker(spec) if spec.get("run_planner") else {}
    if planned:
        spec["policy"] = planned["policy"]
    # Every configuration measures the steady state of a long-running engine, in which each blob's CRC
    # was checked on its first read and is not checked again: check them all here, before timing.
    verify_store(spec)
    # Warm-up (not measured): first-call costs of torch and of the engine's code paths.
    _one_request(spec, prompts[decode_len][:2], 2, trace, {})
    runs, layers = [], {}
    for _ in range(spec["runs"]):
        run = {"requests": {}}
        for n, ids in sorted(prompts.items()):
            max_tokens = spec["decode_tokens"] if n == decode_len else 1
            trace = traces.get(n) if spec["preset"] == "oracle" else None
            run["requests"][str(n)] = _one_request(spec, ids, max_tokens, trace, layers)
        runs.append(run)
    first = runs[0]["requests"][str(decode_len)]
    result = {
        "preset": spec["preset"], "link": spec["link"], "budget_fraction": spec["budget_fraction"],
        "budget_bytes": spec["budget_bytes"], "threads": torch.get_num_threads(),
        "fetch_workers": spec["fetch_workers"], "runs": runs, "median": summarize_runs(runs, decode_len),
        "per_layer": layers, "tokens": first["tokens"], "plan": first["plan"], "direct_io": first["direct_io"],
        "page_cache": first["page_cache"], "peak_rss_bytes": peak_rss_bytes(), "wall_s": time.perf_counter() - t0,
        **planned,
    }
    first_tokens = {n: q["tokens"] for n, q in runs[0]["requests"].items()}
    for r in runs:  # keep the JSON small: one token list per configuration, a flag per run
        for n, q in r["requests"].items():
            q["tokens_equal_first_run"] = q.pop("tokens") == first_tokens[n]
    Path(spec_path + ".result.json").write_text(json.dumps(result))
    return 0


def trace_main(spec_path: str) -> int:
    """Record each request's routing trace (for the oracle) and its int4 reference tokens."""
    import torch

    from .engine import Engine
    from .generate import GenerateConfig

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    prompts = {int(k): v for k, v in spec["prompts"].items()}
    decode_len = min(prompts)
    traces, tokens = {}, {}
    big = int(spec["int4_total"] * 2 + 64e6)  # everything fits: the trace does not depend on the policy
    for n, ids in sorted(prompts.items()):
        engine = Engine(spec["store"], big, "lru", workers=spec["fetch_workers"])
        cfg = GenerateConfig(max_tokens=spec["decode_tokens"] if n == decode_len else 1, ignore_eos=True)
        try:
            traces[n] = engine.record_trace(ids, cfg)
            tokens[n] = [r.token for r in engine.stream(ids, cfg)]  # a second pass, all from the warm cache
        finally:
            engine.close()
    with open(spec["trace_file"], "wb") as f:
        pickle.dump({"traces": traces, "tokens": tokens}, f)
    return 0


# ------------------------------------------------------------------------------------------------ parent side
_CHILD_IDS = itertools.count()


def _run_child(mode: str, spec: dict, tmp: Path, timeout: float, isolate: bool = True
               ) -> tuple[dict | None, str | None]:
    """Run ``python -m fate_edge.bench --<mode> SPEC`` in a fresh process; (result, error).

    ``isolate=False`` runs the same function in this process (tests: no per-configuration peak RSS)."""
    spec_path = tmp / f"{mode}-{next(_CHILD_IDS)}.json"
    spec_path.write_text(json.dumps(spec))
    if not isolate:
        try:
            {"worker": worker_main, "trace": trace_main}[mode](str(spec_path))
        except Exception as exc:  # noqa: BLE001 (reported like a failed child)
            return None, f"{type(exc).__name__}: {exc}"
        out = Path(str(spec_path) + ".result.json")
        return (json.loads(out.read_text()) if mode == "worker" else {}), None
    cmd = [sys.executable, "-m", "fate_edge.bench", f"--{mode}", str(spec_path)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f}s"
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return None, f"exit {proc.returncode}: " + " | ".join(tail)
    out = Path(str(spec_path) + ".result.json")
    if mode != "worker":
        return {}, None
    if not out.exists():
        return None, "worker wrote no result"
    return json.loads(out.read_text()), None


def preflight(store: Path, presets: list[str], budget: int) -> dict[str, str]:
    """Presets that cannot even be built here (e.g. a predictor not written yet) → why."""
    from .engine import Engine, Trace
    from .policy import PRESETS

    skipped = {}
    for name in presets:
        if name not in PRESETS:
            skipped[name] = "not a preset of this version (fate_edge.policy.PRESETS)"
            continue
        try:
            Engine(store, budget, name, trace=Trace() if name == "oracle" else None).close()
        except Exception as exc:  # ImportError of a predictor being written, a missing precision, ...
            skipped[name] = f"{type(exc).__name__}: {exc}"
    return skipped


def link_check(store: Path, choice: LinkChoice, n: int = 8) -> dict[str, Any]:
    """Read ``n`` int4 experts one after another through the link: achieved vs specified bandwidth."""
    from fate_edge.devices.link import ThrottledLink

    from .fetch import BufferPool, FetchEngine, Priority
    from .store import ExpertStore

    spec = choice.spec()
    s = ExpertStore(store)
    refs = [s.ref(layer, e, 4) for layer in s.index["moe_layers"][:2] for e in range(s.index["num_experts"])][:n]
    fe = FetchEngine(BufferPool(2, s.precisions[4].slot_bytes), workers=1,
                     link=ThrottledLink(spec) if spec else None, direct_io=spec is None)
    try:
        if spec is None:
            drop_page_cache()
        t0 = time.perf_counter()
        nbytes = 0
        for ref in refs:
            req = fe.submit(ref, Priority.DEMAND)
            fe.wait(req)
            nbytes += ref.length
            fe.release(req)
        dt = time.perf_counter() - t0
    finally:
        fe.close()
    return {
        "spec_gbps": spec.bandwidth_bytes_per_s / 1e9 if spec else None,
        "spec_latency_us": spec.latency_s * 1e6 if spec else None,
        "achieved_gbps": nbytes / dt / 1e9,
        "per_expert_ms": 1e3 * dt / len(refs),
        "io": fe.direct_io_note,
    }


def _configs(cfg: BenchConfig, info: dict, presets: list[str]) -> list[dict]:
    from .policy import PRESETS

    out = []
    for link in cfg.links:
        for p in presets:
            if not PRESETS[p].cache:  # load-on-demand: no cache; the budget only has to cover its read buffers
                out.append({"link": link, "preset": p, "budget_fraction": None,
                            "budget_bytes": int(info["int4_expert_bytes_total"])})
                continue
            for b in cfg.budgets:
                out.append({"link": link, "preset": p, "budget_fraction": b,
                            "budget_bytes": int(b * info["int4_expert_bytes_total"])})
    return out


def _ratio(a, b):
    return a / b if a is not None and b else None


def compute_ratios(results: list[dict]) -> None:
    """Ratios against load-on-demand (same link) and fate / oracle (same link and budget), from this run."""
    def find(link, preset, budget=None):
        for r in results:
            if r.get("error") is None and r["link"] == link and r["preset"] == preset and (
                    budget is None or r["budget_fraction"] == budget):
                return r
        return None

    for r in results:
        if r.get("error") is not None:
            continue
        refs = {
            "load-on-demand": find(r["link"], "load-on-demand"),
            "load-on-demand-int4": find(r["link"], "load-on-demand-int4"),
            "fate": find(r["link"], "fate", r["budget_fraction"]) if r["budget_fraction"] is not None else None,
            "oracle": find(r["link"], "oracle", r["budget_fraction"]) if r["budget_fraction"] is not None else None,
        }
        m = r["median"]
        ratios: dict[str, dict[str, float | None]] = {}
        for name, ref in refs.items():
            if ref is None:
                continue
            rm = ref["median"]
            ratios[name] = {"decode": _ratio(m["decode_tps"], rm["decode_tps"])}
            for n, v in m["prefill_tps"].items():
                ratios[name][f"prefill_{n}"] = _ratio(v, rm["prefill_tps"].get(n))
        r["ratios"] = ratios  # this / reference: > 1 is faster than the reference


def _int4_reference_tokens(results: list[dict], reference: list[int] | None) -> None:
    """Flag each configuration whose greedy tokens differ from the int4 reference (the trace run)."""
    for r in results:
        if r.get("error") is None:
            r["tokens_match_int4_reference"] = None if reference is None else r["tokens"] == reference


def planner_configs(cfg: BenchConfig, store: Path, info: dict, budgets: list[float]) -> tuple[list[dict], str | None]:
    """One ``planned`` configuration per (link, budget). Its worker process runs the planner (probe, simulate,
    choose) and then measures the chosen policy at once, as ``Engine(plan="auto")`` would: on a shared host
    whose speed drifts from minute to minute, a plan made minutes before its measurement would be compared
    with a different machine."""
    if not cfg.planner:
        return [], "planner not run (--no-planner)"
    try:
        from . import planner  # noqa: F401
    except ImportError:
        return [], "fate_edge.planner not present: no predicted tok/s"
    total = info["int4_expert_bytes_total"]
    return [{"link": link, "preset": "planned", "budget_fraction": b, "budget_bytes": int(b * total),
             "run_planner": True} for link in cfg.links for b in budgets], None


def plan_in_worker(spec: dict) -> dict[str, Any]:
    """The planner's choice for this configuration's link and budget (see :func:`planner_configs`)."""
    from fate_edge.devices.link import LinkSpec

    from .planner import auto_plan

    t0 = time.perf_counter()
    link = LinkSpec(**spec["link_spec"]) if spec["link_spec"] else None
    p = auto_plan(spec["store"], spec["budget_bytes"], link=link, workers=spec["fetch_workers"])
    return {"policy": dataclasses.asdict(p.policy), "planner_predicted_decode_tps": p.predicted_tokens_per_s,
            "planner_costs": p.costs.describe(), "planner_s": time.perf_counter() - t0}


# ------------------------------------------------------------------------------------------------ peers
def _memory_cgroup(limit: int) -> tuple[Path | None, str]:
    """A child memory cgroup of this process's own one, capped at ``limit`` bytes; (path, note)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        v1 = [ln.split(":", 2)[2] for ln in lines if ln.split(":", 2)[1] == "memory"]
        if v1 and Path("/sys/fs/cgroup/memory").is_dir():
            cg = Path("/sys/fs/cgroup/memory") / v1[0].lstrip("/") / f"fate-bench-{os.getpid()}"
            cg.mkdir(exist_ok=True)
            (cg / "memory.limit_in_bytes").write_text(str(limit))
            return cg, f"cgroup v1 memory.limit_in_bytes = {limit / 1e6:.0f} MB"
        v2 = [ln.split(":", 2)[2] for ln in lines if ln.startswith("0::")]
        if v2 and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            cg = Path("/sys/fs/cgroup") / v2[0].lstrip("/") / f"fate-bench-{os.getpid()}"
            cg.mkdir(exist_ok=True)
            (cg / "memory.max").write_text(str(limit))
            return cg, f"cgroup v2 memory.max = {limit / 1e6:.0f} MB"
    except OSError as exc:
        return None, f"no memory cgroup ({exc.strerror or exc}): run without a cap"
    return None, "no memory cgroup controller found: run without a cap"


def _run_peer(kind: str, spec: dict, tmp: Path, timeout: float, cgroup: Path | None = None) -> dict:
    spec_path = tmp / f"peer-{kind}-{spec.get('mode', '')}.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    procs_file = None
    if cgroup is not None:
        procs_file = cgroup / ("cgroup.procs" if (cgroup / "cgroup.procs").exists() else "tasks")

    def join_cgroup():  # runs in the child before exec
        if procs_file is not None:
            procs_file.write_text(str(os.getpid()))

    cmd = [sys.executable, "-m", "fate_edge.bench", "--peer", str(spec_path)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              preexec_fn=join_cgroup if procs_file else None)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s"}
    out = Path(str(spec_path) + ".result.json")
    if proc.returncode != 0 or not out.exists():
        killed = proc.returncode in (-9, 137)
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        return {"error": ("killed (out of memory under the cap?)" if killed else f"exit {proc.returncode}")
                + (f": {tail}" if tail else "")}
    return json.loads(out.read_text())


def peer_main(spec_path: str) -> int:
    import torch

    from .generate import peak_rss_bytes

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    prompts = {int(k): v for k, v in spec["prompts"].items()}
    decode_len = min(prompts)
    res: dict[str, Any] = {"prefill_tps": {}}
    if spec["kind"] == "transformers":
        from transformers import AutoModelForCausalLM, DynamicCache

        if spec["drop_caches"]:
            res["page_cache"] = drop_page_cache()[1]
        model = AutoModelForCausalLM.from_pretrained(
            spec["model_dir"], dtype=torch.bfloat16, device_map="auto",
            max_memory={"cpu": spec["max_memory"]}, offload_folder=spec["offload_dir"]).eval()
        res["device_map"] = sorted({str(v) for v in getattr(model, "hf_device_map", {}).values()})
        with torch.inference_mode():
            for n, ids in sorted(prompts.items()):
                x = torch.tensor([ids])
                cache = DynamicCache(config=model.config)
                t0 = time.perf_counter()
                out = model(x, past_key_values=cache, use_cache=True, logits_to_keep=1)
                t1 = time.perf_counter()
                res["prefill_tps"][str(n)] = n / (t1 - t0)
                if n != decode_len:
                    continue
                tok = out.logits[0, -1].argmax().view(1, 1)
                tokens = [int(tok)]
                t1 = time.perf_counter()
                for _ in range(spec["decode_tokens"] - 1):
                    out = model(tok, past_key_values=out.past_key_values, use_cache=True)
                    tok = out.logits[0, -1].argmax().view(1, 1)
                    tokens.append(int(tok))
                res["decode_tps"] = (spec["decode_tokens"] - 1) / (time.perf_counter() - t1)
                res["tokens"] = tokens
    elif spec["kind"] == "llama.cpp":
        from llama_cpp import Llama

        llm = Llama(model_path=spec["gguf"], n_ctx=max(prompts) + spec["decode_tokens"] + 8,
                    n_threads=spec["threads"], use_mmap=spec["mode"] == "mmap", verbose=False)
        for n, ids in sorted(prompts.items()):
            want = spec["decode_tokens"] if n == decode_len else 1
            t0, times, tokens = time.perf_counter(), [], []
            for tok in llm.generate(ids, top_k=1, temp=0.0, reset=True):
                times.append(time.perf_counter())
                tokens.append(int(tok))
                if len(tokens) >= want:
                    break
            res["prefill_tps"][str(n)] = n / (times[0] - t0)  # includes sampling the first token
            if n == decode_len and len(times) > 1:
                res["decode_tps"] = (len(times) - 1) / (times[-1] - times[0])
                res["tokens"] = tokens
    res["peak_rss_bytes"] = peak_rss_bytes()
    Path(spec_path + ".result.json").write_text(json.dumps(res))
    return 0


def run_peers(cfg: BenchConfig, hf_dir: Path | None, info: dict, prompts: dict, tmp: Path) -> list[dict]:
    peers: list[dict] = []
    budget = int(HEADLINE_BUDGET * info["int4_expert_bytes_total"])
    cap = info["resident_bytes"] + budget  # resident weights + the same expert budget as our 35% column
    base = {"threads": cfg.threads, "prompts": {str(k): v for k, v in prompts.items()},
            "decode_tokens": cfg.decode_tokens, "drop_caches": cfg.drop_caches}
    # transformers + accelerate, disk offload of the same checkpoint
    missing = [m for m in ("transformers", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        msg = f"skipped: {' and '.join(missing)} not installed (pip install transformers accelerate)"
        print(f"bench: peer transformers+accelerate {msg}", flush=True)
        peers.append({"peer": "transformers+accelerate", "mode": "disk offload", "skipped": msg})
    elif hf_dir is None:
        msg = "skipped: --model is a store; the peer needs the Hugging Face checkpoint"
        print(f"bench: peer transformers+accelerate {msg}", flush=True)
        peers.append({"peer": "transformers+accelerate", "mode": "disk offload", "skipped": msg})
    else:
        off = tmp / "offload"
        shutil.rmtree(off, ignore_errors=True)
        t0 = time.perf_counter()
        r = _run_peer("transformers", {**base, "kind": "transformers", "model_dir": str(hf_dir), "max_memory": cap,
                                       "offload_dir": str(off)}, tmp, cfg.timeout_s)
        shutil.rmtree(off, ignore_errors=True)
        r.update(peer="transformers+accelerate", mode="disk offload, bf16",
                 note=f"device_map=auto, max_memory cpu = {cap / 1e6:.0f} MB (resident + 35% expert budget), "
                      "offload_folder on this disk (page cache as the OS leaves it)", wall_s=time.perf_counter() - t0)
        print(f"bench: peer transformers+accelerate: {_peer_line(r)}", flush=True)
        peers.append(r)
    # llama.cpp through llama-cpp-python on a GGUF of the same checkpoint
    if importlib.util.find_spec("llama_cpp") is None:
        msg = "skipped: llama-cpp-python not installed (pip install llama-cpp-python builds llama.cpp, ~20 min here)"
        print(f"bench: peer llama.cpp {msg}", flush=True)
        peers.append({"peer": "llama.cpp", "skipped": msg})
    elif not cfg.gguf:
        msg = "skipped: no --gguf given (README 'Performance' shows how to convert the checkpoint)"
        print(f"bench: peer llama.cpp {msg}", flush=True)
        peers.append({"peer": "llama.cpp", "skipped": msg})
    else:
        for mode in ("ram", "mmap"):
            cg, note = _memory_cgroup(cap)
            try:
                t0 = time.perf_counter()
                r = _run_peer("llama.cpp", {**base, "kind": "llama.cpp", "gguf": cfg.gguf, "mode": mode}, tmp,
                              cfg.timeout_s, cg)
            finally:
                if cg is not None:
                    with contextlib.suppress(OSError):
                        cg.rmdir()
            r.update(peer="llama.cpp", mode="fully in RAM" if mode == "ram" else "memory-mapped", note=note,
                     wall_s=time.perf_counter() - t0)
            print(f"bench: peer llama.cpp ({mode}): {_peer_line(r)}", flush=True)
            peers.append(r)
    return peers


def _peer_line(r: dict) -> str:
    if "error" in r:
        return r["error"]
    pf = ", ".join(f"{n}: {v:.1f}" for n, v in r.get("prefill_tps", {}).items())
    return (f"prefill tok/s {pf}; decode {r.get('decode_tps') or 0:.2f} tok/s; "
            f"peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB")


# ------------------------------------------------------------------------------------------------ main loop
def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    import torch

    t_start = time.perf_counter()
    store, hf_dir, model_desc = prepare_model(cfg)
    info = store_info(store)
    prompts, files = make_prompts(store, sorted(cfg.prompt_tokens))
    decode_len = min(prompts)
    if hf_dir is not None:
        print(f"bench: checkpoint {hf_dir}", flush=True)
    print(f"bench: model {model_desc}; int4 experts total {info['int4_expert_bytes_total'] / 1e6:.1f} MB; "
          f"prompts {sorted(prompts)} tokens from held-out stdlib source ({', '.join(files[:3])}"
          f"{', ...' if len(files) > 3 else ''}); {cfg.threads} torch threads", flush=True)
    if cfg.quick:
        print(f"bench: {QUICK_NOTE}", flush=True)

    skipped = preflight(store, cfg.presets, int(HEADLINE_BUDGET * info["int4_expert_bytes_total"]))
    for name, why in skipped.items():
        print(f"bench: skipping preset {name}: {why}", flush=True)
    presets = [p for p in cfg.presets if p not in skipped]

    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="fate-bench-", dir=out_dir))
    common = {"store": str(store), "threads": cfg.threads, "fetch_workers": cfg.fetch_workers, "device": cfg.device,
              "prompts": {str(k): v for k, v in prompts.items()}, "decode_tokens": cfg.decode_tokens}

    # 1. the routing trace of each request (oracle) and the int4 reference tokens, in a process of its own
    trace_file = tmp / "traces.pkl"
    reference = None
    t0 = time.perf_counter()
    _, err = _run_child("trace", {**common, "trace_file": str(trace_file),
                                  "int4_total": info["int4_expert_bytes_total"]}, tmp, cfg.timeout_s, cfg.isolate)
    if err is None:
        with open(trace_file, "rb") as f:
            reference = pickle.load(f)["tokens"].get(decode_len)
        print(f"bench: recorded routing traces ({time.perf_counter() - t0:.1f}s)", flush=True)
    else:
        print(f"bench: trace recording failed ({err}); skipping oracle", flush=True)
        if "oracle" in presets:
            presets.remove("oracle")
            skipped["oracle"] = f"trace recording failed: {err}"

    # 2. link calibration: what each emulated link achieves on this machine
    links_out = {}
    for key in cfg.links:
        choice = LINKS[key]
        spec = choice.spec()
        if spec is not None:
            warm_page_cache(store)
        try:
            check = link_check(store, choice)
        except Exception as exc:  # noqa: BLE001
            check = {"error": f"{type(exc).__name__}: {exc}"}
        links_out[key] = {"title": choice.title, "profile": choice.profile, "kind": choice.kind,
                          "source": choice.source, "name": spec.name if spec else "raw disk", "check": check}
        print(f"bench: link {key}: {json.dumps(check)}", flush=True)

    # 3. every configuration in a fresh process (planned ones: see the planner hook). Phase 1 is the headline
    # budget (and load-on-demand); then the peers; then the other budgets, farthest from the headline first.
    # With a time limit (--quick), configurations that would start after it are listed as dropped.
    hb = _headline_budget(cfg.budgets)
    rest = sorted((b for b in cfg.budgets if b != hb), key=lambda b: -abs(b - hb))
    deadline = t_start + cfg.time_limit_s if cfg.time_limit_s else None
    results: list[dict] = []
    dropped: list[str] = []
    failed_presets: dict[str, str] = {}
    planner_notes: list[str] = []
    state = {"warmed": None, "n": 0}

    def run_phase(budgets: list[float], with_lod: bool) -> None:
        configs = [c for c in _configs(cfg, info, presets)
                   if (c["budget_fraction"] is None and with_lod) or c["budget_fraction"] in budgets]
        if deadline is None or time.perf_counter() < deadline:
            planned, note = planner_configs(cfg, store, info, budgets)
            configs += planned
            if note:
                planner_notes.append(note)
        # Rounds: every configuration's run r happens before any configuration's run r + 1, each in a fresh
        # process, so a median samples the host at ``runs`` different times: this shared host's speed drifts
        # over tens of seconds, and back-to-back runs of one configuration would all share one phase.
        done: dict[int, list[dict]] = {}
        for rnd in range(cfg.runs):
            for i, c in enumerate(configs):
                label = f"{c['link']} {c['preset']} " + (
                    f"{100 * c['budget_fraction']:.0f}%" if c["budget_fraction"] is not None else "(no cache)")
                if deadline is not None and time.perf_counter() > deadline:
                    if rnd == 0:
                        dropped.append(label)
                    elif i in done:
                        done[i][0].setdefault("note", f"{len(done[i])} of {cfg.runs} runs (time limit)")
                    continue
                if c["preset"] in failed_presets or (rnd > 0 and i not in done):
                    if rnd == 0:
                        why = failed_presets[c["preset"]]
                        results.append({**c, "error": f"skipped after an earlier failure: {why}"})
                    continue
                spec_link = LINKS[c["link"]].spec()
                if spec_link is not None and state["warmed"] != c["link"]:
                    warm_page_cache(store)
                    state["warmed"] = c["link"]
                elif spec_link is None:
                    state["warmed"] = None
                spec = {**common, **c, "runs": 1, "drop_caches": cfg.drop_caches,
                        "link_spec": dataclasses.asdict(spec_link) if spec_link is not None else None,
                        "trace_file": str(trace_file) if c["preset"] == "oracle" else None}
                t0 = time.perf_counter()
                res, err = _run_child("worker", spec, tmp, cfg.timeout_s, cfg.isolate)
                state["n"] += 1
                label = f"[{state['n']}] {label} (run {rnd + 1}/{cfg.runs})"
                if err is not None:
                    print(f"bench: {label}: FAILED {err}", flush=True)
                    done.pop(i, None)
                    results.append({**c, "error": err})
                    if "BudgetError" not in err:
                        failed_presets[c["preset"]] = err
                    continue
                m = res["median"]
                pf = " ".join(f"{n}:{v:.1f}" for n, v in m["prefill_tps"].items())
                print(f"bench: {label}: decode {m['decode_tps'] or 0:.2f} tok/s, prefill {pf} tok/s, hit "
                      f"{100 * (m['hit_rate'] or 0):.0f}%, stall {m['stall_ms_per_token'] or 0:.1f} ms/tok, "
                      f"{m['mb_read_per_token'] or 0:.2f} MB/tok, RSS {res['peak_rss_bytes'] / 2**20:.0f} MiB "
                      f"({time.perf_counter() - t0:.0f}s; {time.perf_counter() - t_start:.0f}s total)"
                      + (f"; planner predicted {res['planner_predicted_decode_tps']:.2f} decode tok/s"
                         if res.get("planner_predicted_decode_tps") else ""), flush=True)
                done.setdefault(i, []).append(res)
        for i in sorted(done):
            results.append(merge_runs(done[i], min(prompts)))

    run_phase([hb], with_lod=True)
    # 4. peers
    if not cfg.peers:
        peers = [{"skipped": "--no-peers"}]
    elif deadline is not None and time.perf_counter() > deadline:
        peers = [{"skipped": "--quick time limit reached before the peers"}]
        dropped.append("peers")
    else:
        peers = run_peers(cfg, hf_dir, info, prompts, tmp)
    run_phase(rest, with_lod=False)
    if dropped:
        print(f"bench: dropped by the time limit ({cfg.time_limit_s:.0f}s): {', '.join(dropped)}", flush=True)

    compute_ratios(results)
    _int4_reference_tokens(results, reference)
    for r in results:
        if r.get("planner_predicted_decode_tps") and r.get("median", {}).get("decode_tps"):
            r["planner_error"] = r["planner_predicted_decode_tps"] / r["median"]["decode_tps"] - 1
    planner_note = "; ".join(dict.fromkeys(planner_notes)) or None
    shutil.rmtree(tmp, ignore_errors=True)

    commit = None
    with contextlib.suppress(Exception):
        commit = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "machine": {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
                    "torch": torch.__version__, "python": platform.python_version()},
        "threads": {"torch": cfg.threads, "fetch_workers": cfg.fetch_workers},
        "quick": cfg.quick,
        "quick_note": QUICK_NOTE if cfg.quick else None,
        "config": dataclasses.asdict(cfg),
        "model": {"description": model_desc, "checkpoint": str(hf_dir) if hf_dir else None, **info},
        "prompts": {"lengths": sorted(prompts), "decode_tokens": cfg.decode_tokens, "source_files": files,
                    "decode_prompt": decode_len, "greedy": True},
        "links": links_out,
        "skipped_presets": skipped,
        "dropped_by_time_limit": dropped,
        "planner": planner_note,
        "int4_reference_tokens": reference,
        "results": results,
        "peers": peers,
        "wall_s": time.perf_counter() - t_start,
    }


# ------------------------------------------------------------------------------------------------ reporting
def _fmt(v, spec=".2f", none="—"):
    return none if v is None else format(v, spec)


def _x(v):
    return "—" if v is None else f"{v:.2f}x"


def _find(results, link, preset, budget):
    for r in results:
        if r.get("error") is None and r["link"] == link and r["preset"] == preset and (
                r["budget_fraction"] is None or r["budget_fraction"] == budget):
            return r
    return None


def _headline_budget(budgets: list[float]) -> float:
    return min(budgets, key=lambda b: abs(b - HEADLINE_BUDGET))


def markdown(result: dict) -> str:
    cfg, info, results = result["config"], result["model"], result["results"]
    budgets = sorted(cfg["budgets"])
    presets = [p for p in ALL_PRESETS if any(r["preset"] == p for r in results)] + sorted(
        {r["preset"] for r in results} - set(ALL_PRESETS))
    eb = info["expert_bytes"]
    lines = [
        f"Model: {info['description']}: {info['moe_layers']} MoE layers x {info['num_experts']} experts, top-"
        f"{info['experts_per_token']}; one expert is {int(eb['4']) / 1e6:.2f} MB int4"
        + (f" / {int(eb['2']) / 1e6:.2f} MB int2" if "2" in eb else "")
        + (f" / {int(eb['16']) / 1e6:.2f} MB bf16" if "16" in eb else "")
        + f"; all int4 experts {info['int4_expert_bytes_total'] / 1e6:.0f} MB. Budgets are shares of that "
        f"(cache + read buffers + the expert being computed). "
        f"Prompts: {', '.join(map(str, result['prompts']['lengths']))} "
        f"tokens of held-out Python source, then {result['prompts']['decode_tokens']} greedy tokens. "
        f"{result['threads']['torch']} torch threads + {result['threads']['fetch_workers']} fetch threads on "
        f"{result['machine']['cpu']} ({result['machine']['cpu_count']} CPUs), torch {result['machine']['torch']}; "
        f"{'median of ' + str(cfg['runs']) + ' runs' if cfg['runs'] > 1 else '1 run'}, "
        f"{'taken in rounds, each run in a fresh process' if cfg.get('isolate', True) else 'in one process'}, "
        f"every request on a cold engine after one warm-up request. {result['date']}, commit {result['commit']}, "
        f"`python scripts/bench.py{' --quick' if result['quick'] else ''}`.",
    ]
    if result.get("quick_note"):
        lines += ["", f"Quick mode: {result['quick_note']}."]
    if result.get("dropped_by_time_limit"):
        lines += ["", "Dropped by the time limit: " + ", ".join(result["dropped_by_time_limit"]) + "."]
    if result.get("planner"):
        lines += ["", f"Planner: {result['planner']}."]
    for link in cfg["links"]:
        if link not in result["links"]:
            continue
        L = result["links"][link]
        chk = L["check"]
        spec_txt = (f"{chk.get('spec_gbps', 0):.3g} GB/s, {chk.get('spec_latency_us', 0):.0f} us/request"
                    if chk.get("spec_gbps") else "unthrottled")
        pc = [r["page_cache"] for r in results if r.get("link") == link and r.get("page_cache")]
        if pc:
            spec_txt += "; page cache " + ("dropped before every request" if all(x["dropped"] for x in pc)
                                           else f"NOT dropped ({pc[0]['note']})")
        lines += ["", f"**Decode tokens/s, {L['title']}** ({spec_txt}; measured through the fetch engine: "
                  f"{_fmt(chk.get('achieved_gbps'), '.3g')} GB/s, {chk.get('io', '?')}); in brackets: x load-on-demand "
                  "(bf16) from the same run.", "",
                  "| policy | " + " | ".join(f"{100 * b:.0f}%" for b in budgets) + " |",
                  "|---|" + "---:|" * len(budgets)]
        for p in presets:
            cells = []
            for j, b in enumerate(budgets):
                r = _find(results, link, p, b)
                if r is None:
                    cells.append("—")
                    continue
                if r["budget_fraction"] is None and j > 0:
                    cells.append("〃")
                    continue
                x = r.get("ratios", {}).get("load-on-demand", {}).get("decode")
                cells.append(f"{_fmt(r['median']['decode_tps'])} ({_x(x)})")
            lines.append(f"| {LABELS.get(p, p)} | " + " | ".join(cells) + " |")

    head_link = cfg["links"][0]
    hb = _headline_budget(budgets)
    lens = [str(n) for n in result["prompts"]["lengths"]]
    planner = any("planner_predicted_decode_tps" in r for r in results)
    lines += ["", f"**At {100 * hb:.0f}% ({hb * info['int4_expert_bytes_total'] / 1e6:.0f} MB) on "
              f"{result['links'][head_link]['title']}**: ratios are this policy's decode "
              "tok/s over the reference's (same run, same link, same budget); \"oracle/this\" is how far the bound "
              "is ahead. Hit rate = expert uses served from the cache or a prefetch issued before the layer; "
              "exact = predicted top-k equal to the true top-k (decode).", ""]
    hdr = (["policy", "decode tok/s"] + [f"prefill {n} tok/s" for n in lens]
           + ["hit rate", "exact", "stall ms/tok", "MB read/tok", "peak RSS MiB", "x LOD bf16", "x LOD int4", "x fate",
              "oracle/this"] + (["planner predicted"] if planner else []))
    lines += ["| " + " | ".join(hdr) + " |", "|---|" + "---:|" * (len(hdr) - 1)]
    for p in presets:
        r = _find(results, head_link, p, hb)
        if r is None:
            continue
        m, ra = r["median"], r.get("ratios", {})
        oracle = ra.get("oracle", {}).get("decode")
        row = ([LABELS.get(p, p), _fmt(m["decode_tps"])] + [_fmt(m["prefill_tps"].get(n), ".1f") for n in lens]
               + [_fmt(None if m["hit_rate"] is None else 100 * m["hit_rate"], ".0f") + "%",
                  _fmt(None if m["exact_match"] is None else 100 * m["exact_match"], ".0f", "—")
                  + ("%" if m["exact_match"] is not None else ""),
                  _fmt(m["stall_ms_per_token"], ".1f"), _fmt(m["mb_read_per_token"], ".2f"),
                  f"{r['peak_rss_bytes'] / 2**20:.0f}",
                  _x(ra.get("load-on-demand", {}).get("decode")),
                  _x(ra.get("load-on-demand-int4", {}).get("decode")),
                  _x(ra.get("fate", {}).get("decode")),
                  _x(1 / oracle if oracle else None)])
        if planner:
            row.append(_fmt(r.get("planner_predicted_decode_tps")))
        lines.append("| " + " | ".join(row) + " |")
    planned = [r for r in results if r["preset"] == "planned" and r.get("median")]
    if planned:
        lines += ["", "**Planner**: its predicted decode tok/s for the configuration it picked (simulated over its "
                  "own probe's decode trace with the host costs it measured) against that configuration's "
                  "measured decode tok/s in this run.", "",
                  "| link | budget | picked | predicted (per round) | measured (per round) | error | host costs "
                  "(first round's probe) |",
                  "|---|---:|---|---:|---:|---:|---|"]
        for r in sorted(planned, key=lambda r: (r["link"], r["budget_fraction"])):
            q = r.get("policy", {})
            width = f"mass {q.get('prefetch_mass')}" if q.get("prefetch_width") == "mass" else q.get("prefetch_width")
            pick = (f"{q.get('allocation')}/{q.get('eviction')}, " + (f"{q['predictor']} p={q.get('lookahead')} "
                    f"w={width}" if q.get("predictor") else "no prefetch"))
            err = r.get("planner_error")
            rounds = r.get("planner_predictions") or []
            measured = [q["requests"][str(min(result["prompts"]["lengths"]))].get("decode_tps") for q in r["runs"]]
            pred_s = _fmt(r.get("planner_predicted_decode_tps")) + (
                " (" + ", ".join(f"{v:.1f}" for v in rounds) + ")" if len(rounds) > 1 else "")
            meas_s = _fmt(r["median"]["decode_tps"]) + (
                " (" + ", ".join(_fmt(v, ".1f") for v in measured) + ")" if len(measured) > 1 else "")
            lines.append(f"| {result['links'][r['link']]['title']} | {100 * r['budget_fraction']:.0f}% | {pick} | "
                         f"{pred_s} | {meas_s} | "
                         + (f"{100 * err:+.0f}%" if err is not None else "—") + f" | {r.get('planner_costs', '')} |")
    mism = [f"{r['link']}/{r['preset']}/{r['budget_fraction']}" for r in results
            if r.get("tokens_match_int4_reference") is False and r["preset"] not in ("load-on-demand",)]
    if result["int4_reference_tokens"] is not None:
        lines += ["", "Greedy tokens equal to the int4 reference in every int4 configuration" if not mism else
                  "Greedy tokens differ from the int4 reference in: " + ", ".join(mism)
                  + " (fate's int2 prefill tail changes the answer)" * any("/fate/" in s for s in mism)]
    peers = [pr for pr in result["peers"] if "peer" in pr]
    if peers:
        lines += ["", "**Peers** (same checkpoint, same prompts and threads):", "",
                  "| peer | mode | " + " | ".join(f"prefill {n} tok/s" for n in lens)
                  + " | decode tok/s | peak RSS MiB | note |", "|---|---|" + "---:|" * (len(lens) + 2) + "---|"]
        for pr in peers:
            if "skipped" in pr or "error" in pr:
                lines.append(f"| {pr['peer']} | {pr.get('mode', '')} | " + " | ".join("—" for _ in lens)
                             + f" | — | — | {pr.get('skipped') or pr.get('error')} |")
                continue
            lines.append(f"| {pr['peer']} | {pr['mode']} | "
                         + " | ".join(_fmt(pr["prefill_tps"].get(n), ".1f") for n in lens)
                         + f" | {_fmt(pr.get('decode_tps'))} | {pr['peak_rss_bytes'] / 2**20:.0f} "
                         f"| {pr.get('note', '')} |")
    if result["skipped_presets"]:
        lines += ["", "Skipped presets: " + "; ".join(f"{k} ({v})" for k, v in result["skipped_presets"].items())]
    errors = [r for r in results if r.get("error")]
    if errors:
        lines += ["", "Failed configurations: " + "; ".join(
            f"{r['link']}/{r['preset']}/{r['budget_fraction']}: {r['error']}" for r in errors)]
    lines += ["", "Links: " + "; ".join(f"{v['title']}: {v['source']}" for v in result["links"].values()) + "."]
    return "\n".join(lines)


def plots(result: dict, path: Path) -> list[Path]:
    """Tokens/s vs budget per policy per link, and the per-layer decode hit rate at 35%."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("bench: matplotlib not installed: no plots (pip install matplotlib)", flush=True)
        return []
    cfg, results = result["config"], result["results"]
    budgets = sorted(cfg["budgets"])
    links = [k for k in cfg["links"] if k in result["links"]]
    ok = {r["preset"] for r in results if not r.get("error")}
    presets = [p for p in ALL_PRESETS if p in ok] + sorted(ok - set(ALL_PRESETS))
    lens = [str(n) for n in result["prompts"]["lengths"]]
    colors = {p: f"C{i % 10}" for i, p in enumerate(ALL_PRESETS + sorted(ok - set(ALL_PRESETS)))}
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(len(links), 2, figsize=(11, 3.6 * len(links)), squeeze=False)
    for row, link in enumerate(links):
        panels = [("decode", "decode tok/s"), (lens[0], f"prefill tok/s ({lens[0]} tokens)")]
        for col, (metric, title) in enumerate(panels):
            ax = axes[row][col]
            for p in presets:
                pts = []
                for b in budgets:
                    r = _find(results, link, p, b)
                    if r is not None:
                        m = r["median"]
                        pts.append((100 * b, m["decode_tps"] if metric == "decode" else m["prefill_tps"].get(metric)))
                pts = [(x, y) for x, y in pts if y]
                if not pts:
                    continue
                r0 = _find(results, link, p, budgets[0])
                if r0 is not None and r0["budget_fraction"] is None:
                    ax.axhline(pts[0][1], ls="--", color=colors[p], label=LABELS.get(p, p))
                else:
                    ax.plot(*zip(*pts), marker="o", color=colors[p], label=p)
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_xticks([100 * b for b in budgets])
            ax.set_xlabel("expert budget, % of int4 expert bytes")
            ax.set_ylabel(title)
            ax.set_title(result["links"][link]["title"], fontsize=10)
            ax.grid(alpha=0.3, which="both")
        axes[row][1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written = [path]

    hb = _headline_budget(budgets)
    layers_path = path.with_name(path.stem + "_layers" + path.suffix)
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for p in presets:
        r = _find(results, links[0], p, hb)
        if r is None or r["budget_fraction"] is None or not r["per_layer"].get("decode"):
            continue  # load-on-demand keeps nothing: 0% everywhere
        per = sorted((int(k), v) for k, v in r["per_layer"]["decode"].items())
        xs = [k for k, _ in per]
        ys = [100 * (c + f) / max(1, c + f + m) for _, (c, f, m) in per]
        ax.plot(xs, ys, marker="o", color=colors[p], label=LABELS.get(p, p))
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("decode hit rate, % (cache + prefetch)")
    ax.set_title(f"Per-layer hit rate at {100 * hb:.0f}% budget, {result['links'][links[0]]['title']}", fontsize=10)
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(layers_path, dpi=110)
    plt.close(fig)
    return written + [layers_path]


def update_readme(readme: Path, text: str) -> None:
    check_readme(readme)
    replace_between_markers(readme, "bench", text)


def write_outputs(result: dict, cfg: BenchConfig) -> dict[str, Path]:
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "bench_quick" if cfg.quick else "bench"
    json_path = Path(cfg.json_path) if cfg.json_path else out / f"{stem}.json"
    md_path = Path(cfg.md_path) if cfg.md_path else out / f"{stem}.md"
    plot_path = Path(cfg.plot_path) if cfg.plot_path else (
        (REPO_ROOT / "docs" / f"{stem}.png") if cfg.readme else out / f"{stem}.png")
    written = plots(result, plot_path)
    md = markdown(result)
    if written:
        rel = [os.path.relpath(p, Path(cfg.readme).resolve().parent) if cfg.readme else str(p) for p in written]
        md += "\n\n" + "\n".join(f"![{'tokens/s vs budget' if i == 0 else 'per-layer hit rate'}]({r})"
                                 for i, r in enumerate(rel))
    result["outputs"] = {"json": str(json_path), "markdown": str(md_path), "plots": [str(p) for p in written]}
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1))
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(md + "\n")
    if cfg.readme:
        update_readme(Path(cfg.readme), md)
    return {"json": json_path, "markdown": md_path, **{f"plot{i}": p for i, p in enumerate(written)}}


# ------------------------------------------------------------------------------------------------ CLI
def add_arguments(ap: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    ap.add_argument("--model", default=None, help="model directory or expert store (default: the bundled model "
                    "inflated to ~2 MB int4 experts)")
    ap.add_argument("--int4-expert-mb", type=float, default=d.int4_expert_mb,
                    help="size of one int4 expert in the inflated bundled model (without --model)")
    ap.add_argument("--quick", action="store_true", help=QUICK_NOTE.replace("%", "%%"))
    ap.add_argument("--presets", nargs="+", default=None, metavar="PRESET", help=f"default: {' '.join(ALL_PRESETS)}")
    ap.add_argument("--budgets", nargs="+", type=float, default=None, metavar="FRACTION",
                    help="shares of the int4 expert bytes (default 0.2 0.35 0.5 0.75)")
    ap.add_argument("--links", nargs="+", default=None, choices=list(LINKS), metavar="LINK",
                    help=f"default: {' '.join(LINKS)}")
    ap.add_argument("--prompt-tokens", nargs="+", type=int, default=None, help="default 128 512")
    ap.add_argument("--decode-tokens", type=int, default=None, help=f"default {d.decode_tokens}")
    ap.add_argument("--runs", type=int, default=None, help=f"default {d.runs}; medians are reported")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: all CPUs)")
    ap.add_argument("--fetch-workers", type=int, default=d.fetch_workers)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (experts cached on the GPU)")
    ap.add_argument("--no-peers", action="store_true", help="do not run transformers / llama.cpp")
    ap.add_argument("--gguf", default=None, help="GGUF of the same checkpoint for the llama.cpp peer")
    ap.add_argument("--no-planner", action="store_true", help="skip the planner hook (planned configurations)")
    ap.add_argument("--no-drop-caches", action="store_true", help="raw disk: keep the page cache")
    ap.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds per configuration")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds for the whole run: later configurations are dropped and listed (quick: 480)")
    ap.add_argument("--out-dir", default=d.out_dir)
    ap.add_argument("--json", default=None, help="default OUT_DIR/bench[_quick].json")
    ap.add_argument("--markdown", default=None, help="default OUT_DIR/bench[_quick].md")
    ap.add_argument("--plot", default=None, help="default docs/bench[_quick].png with --readme, else OUT_DIR/")
    ap.add_argument("--readme", default=None, help="rewrite the table between the bench markers of this file")
    ap.add_argument("--work-dir", default=None, help="where the inflated model and its store are kept")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    cfg = BenchConfig(model=args.model, int4_expert_mb=args.int4_expert_mb, threads=args.threads,
                      fetch_workers=args.fetch_workers,
                      peers=not args.no_peers, gguf=args.gguf, planner=not args.no_planner,
                      drop_caches=not args.no_drop_caches,
                      timeout_s=args.timeout, out_dir=args.out_dir, json_path=args.json, md_path=args.markdown,
                      plot_path=args.plot, readme=args.readme, work_dir=args.work_dir, device=args.device)
    explicit = set()
    for name, attr in [("presets", "presets"), ("budgets", "budgets"), ("links", "links"),
                       ("prompt_tokens", "prompt_tokens"), ("decode_tokens", "decode_tokens"), ("runs", "runs"),
                       ("time_limit_s", "time_limit")]:
        v = getattr(args, attr)
        if v is not None:
            setattr(cfg, name, v)
            explicit.add(name)
    if args.quick:
        apply_quick(cfg, explicit)
    return cfg


def check_readme(readme: Path) -> None:
    content = readme.read_text() if readme.exists() else ""
    if README_BEGIN not in content or README_END not in content:
        raise SystemExit(f"{readme}: no {README_BEGIN} ... {README_END} markers to fill")


def run_from_args(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if cfg.readme:  # fail now, not after the run
        check_readme(Path(cfg.readme))
    result = run_bench(cfg)
    paths = write_outputs(result, cfg)
    print(markdown(result))
    print(f"bench: done in {result['wall_s']:.0f}s; wrote " + ", ".join(str(p) for p in paths.values()), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("--worker", "--trace", "--peer"):
        return {"--worker": worker_main, "--trace": trace_main, "--peer": peer_main}[argv[0]](argv[1])
    ap = argparse.ArgumentParser(prog="bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return run_from_args(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
