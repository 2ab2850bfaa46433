"""fate-edge at a real model's size (issue #13): convert a full-size checkpoint inside a memory cgroup, then run
the store at a few expert budgets from the raw disk (page cache dropped), each run in a process confined by a
memory cgroup to what fate-edge says it needs (``footprint.memory_need``). Used by scripts/bench_scale.py.

Every measurement runs in a fresh child (``python -m fate_edge.bench.scale --child KIND SPEC``) so its peak RSS
is its own; the parent owns the cgroups, drops the page cache and records the load average beside each number.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..convert import ConvertOptions
from .peers import _memory_cgroup
from .prepare import drop_page_cache

GB = 1e9


@dataclass
class ScaleConfig:
    model: Path  # Hugging Face checkpoint at real shapes (scripts/make_synthetic_model.py --like ...)
    store: Path  # where the expert store is (or will be) written
    budgets: list[int] = field(default_factory=lambda: [int(2 * GB), int(4 * GB)])  # expert budgets
    convert: bool = True  # convert first (else the store must exist)
    convert_limit: int = int(2 * GB)  # the convert child's memory cap
    convert_opts: ConvertOptions = field(default_factory=lambda: ConvertOptions(keep_bf16=False))  # int4 only
    policy: str = "fate-edge"
    dtype: str = "bfloat16"  # resident weights and activations
    prompt_tokens: int = 64
    decode_tokens: int = 16
    threads: int = 2  # torch threads of the run child
    fetch_workers: int = 2
    timeout_s: float = 3600.0
    drop_caches: bool = True  # drop the page cache before each measurement (root); off: reads may hit it
    disk_probe_bytes: int = int(1 * GB)  # written and read back to measure the disk


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _cgroup_stats(cg: Path) -> dict[str, Any]:
    """Peak charge and OOM kills of a cgroup (v1 or v2)."""
    out: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        if (cg / "memory.max_usage_in_bytes").exists():  # v1
            out["peak_bytes"] = int((cg / "memory.max_usage_in_bytes").read_text())
            oom = dict(ln.split() for ln in (cg / "memory.oom_control").read_text().splitlines())
            out["oom_kills"] = int(oom.get("oom_kill", 0))
        else:  # v2
            if (cg / "memory.peak").exists():
                out["peak_bytes"] = int((cg / "memory.peak").read_text())
            events = dict(ln.split() for ln in (cg / "memory.events").read_text().splitlines())
            out["oom_kills"] = int(events.get("oom_kill", 0))
    return out


def run_confined(kind: str, spec: dict, limit: int, workdir: Path, timeout_s: float) -> dict[str, Any]:
    """Run child ``kind`` on ``spec`` in a fresh memory cgroup capped at ``limit`` bytes; its result plus the
    cgroup's peak charge, OOM kills and the load average before and after."""
    spec_path = workdir / f"scale-{kind}-{spec.get('label', '')}.json"
    spec_path.write_text(json.dumps(spec))
    result_path = Path(str(spec_path) + ".result.json")
    result_path.unlink(missing_ok=True)
    cg, note = _memory_cgroup(limit)
    procs = None if cg is None else cg / ("cgroup.procs" if (cg / "cgroup.procs").exists() else "tasks")
    info: dict[str, Any] = {"limit_bytes": limit, "cgroup": note, "load_before": load()}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "fate_edge.bench.scale", "--child", kind, str(spec_path)],
                              timeout=timeout_s, stdout=subprocess.PIPE, stderr=None, text=True,
                              preexec_fn=(lambda: procs.write_text(str(os.getpid()))) if procs else None)
        info["returncode"] = proc.returncode
    except subprocess.TimeoutExpired:
        info["returncode"] = None
        info["error"] = f"timed out after {timeout_s:.0f}s"
    info["wall_s"] = time.perf_counter() - t0
    info["load_after"] = load()
    if cg is not None:
        info.update(_cgroup_stats(cg))
        with contextlib.suppress(OSError):
            cg.rmdir()
    if result_path.exists():
        info.update(json.loads(result_path.read_text()))
    elif "error" not in info:
        info["error"] = f"child exited {info['returncode']} without a result" + (
            " (killed by the OOM killer)" if info.get("oom_kills") else "")
    return info


# ----------------------------------------------------------------------------------------------- children
def _rss(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    return 0


def convert_child(spec: dict) -> dict[str, Any]:
    """``fate-edge convert`` with a progress log: (seconds, bytes) samples and this process's peak RSS."""
    from ..convert import convert

    opts = ConvertOptions(**spec["opts"] | {"force": True})
    t0, samples = time.perf_counter(), []

    def on_progress(done: int, total: int) -> None:
        now = time.perf_counter() - t0
        if not samples or now - samples[-1][0] >= 1.0 or done == total:
            samples.append((round(now, 2), done))

    convert(spec["model"], spec["store"], opts, progress=sys.stderr.isatty(), on_progress=on_progress)
    seconds = time.perf_counter() - t0
    total = samples[-1][1] if samples else 0
    written = sum(f.stat().st_size for f in Path(spec["store"]).iterdir() if f.is_file())
    return {"seconds": seconds, "source_bytes": total, "written_bytes": written, "gb_per_s": total / seconds / GB,
            "peak_rss_bytes": _rss("VmHWM"), "progress": samples}


def run_child(spec: dict) -> dict[str, Any]:
    """One request on the store at one budget from a cold page cache: prefill and decode speed, hit rate,
    bytes read per token, peak RSS next to the resident weights and the baseline measured before loading."""
    import torch

    baseline = _rss("VmRSS")  # interpreter + torch + fate_edge imported, nothing loaded
    from ..engine import Engine
    from ..generate import GenerateConfig
    from ..tokenizer import Tokenizer
    from .worker import _stats_dict, _sum_stats

    torch.set_num_threads(spec["threads"])
    tok = Tokenizer(spec["store"])
    text = " ".join(["The expert cache streams weights from the disk while the model decodes."] * 64)
    ids = tok.encode(text)[: spec["prompt_tokens"]]
    t0 = time.perf_counter()
    engine = Engine(spec["store"], spec["budget"], spec["policy"], dtype=spec["dtype"],
                    workers=spec["fetch_workers"], direct_io=True)
    load_s = time.perf_counter() - t0
    resident = sum(t.numel() * t.element_size() for t in engine.model.w.values())
    try:
        times, steps = [], []
        for step in engine.stream(ids, GenerateConfig(max_tokens=spec["decode_tokens"] + 1, ignore_eos=True)):
            times.append(time.perf_counter())
            steps.append(step)
        last = steps[-1]
        decode = _sum_stats(engine.token_stats)
        n_dec = len(engine.token_stats)
        pre = engine.prefill_stats
        out = {
            "load_s": load_s, "resident_bytes": resident, "baseline_rss_bytes": baseline,
            "prompt_tokens": len(ids), "prefill_tps": last.prompt_tps,
            "decode_tokens": n_dec, "decode_tps": n_dec / (times[-1] - times[0]) if n_dec > 0 else None,
            "decode_hit_rate": decode.hit_rate, "prefill_hit_rate": pre.hit_rate,
            "decode_mb_read_per_token": (decode.demand_bytes + decode.prefetch_bytes) / max(n_dec, 1) / 1e6,
            "prefill_mb_read": (pre.demand_bytes + pre.prefetch_bytes) / 1e6,
            "decode": _stats_dict(decode), "prefill": _stats_dict(pre),
            "plan": {"cache_bytes": engine.plan.cache_bytes, "pool_bytes": engine.plan.pool_bytes,
                     "entry_bytes": engine.plan.entry_bytes},
            "direct_io": engine.fetch.direct_io_note,
        }
    finally:
        engine.close()
    out["peak_rss_bytes"] = _rss("VmHWM")
    return out


CHILDREN = {"convert": convert_child, "run": run_child}


def child_main(kind: str, spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    result = CHILDREN[kind](spec)
    Path(spec_path + ".result.json").write_text(json.dumps(result))
    return 0


# ----------------------------------------------------------------------------------------------- parent
def measure_disk(directory: Path, nbytes: int = int(1 * GB), drop: bool = True) -> dict[str, Any]:
    """Sequential write (fsync'd) and cold read of ``nbytes`` in ``directory``: what bounds convert's I/O."""
    path = directory / f".disk-probe-{os.getpid()}"
    block = os.urandom(16 << 20)
    try:
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            for _ in range(nbytes // len(block)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        write_s = time.perf_counter() - t0
        dropped = drop and drop_page_cache()[0]
        t0 = time.perf_counter()
        with open(path, "rb") as f:
            while f.read(16 << 20):
                pass
        read_s = time.perf_counter() - t0
    finally:
        path.unlink(missing_ok=True)
    n = nbytes // len(block) * len(block)
    return {"write_gb_per_s": n / write_s / GB, "read_gb_per_s": n / read_s / GB, "page_cache_dropped": dropped,
            "bytes": n, "load": load()}


def measure_encoder(model: Path, opts: ConvertOptions, experts: int = 24, threads: int | None = None) -> dict:
    """The encoder alone (experts already in memory) on ``threads`` workers, in GB/s of checkpoint bytes."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from fate_edge.quant.rtn import BLOCK_BYTES

    from ..arch import load_config
    from ..checkpoint import CheckpointReader
    from ..convert import _one_torch_thread, _precisions, pick_group
    from ..experts import ExpertLayout
    from ..loader import layer_names
    from ..store import encode_expert

    cfg = load_config(model)
    reader = CheckpointReader(model)
    layout = ExpertLayout(reader, layer_names(cfg, reader)[cfg.moe_layers[0]].mlp)
    group = pick_group((cfg.hidden_size, cfg.moe_intermediate_size), opts.group_size)
    precisions = _precisions(cfg, replace(opts, group_size=group))
    ws = [layout.read(e % cfg.num_experts, None) for e in range(experts)]
    nbytes = sum(w.nbytes for w in ws)
    threads = threads or min(os.cpu_count() or 1, 8)

    def job(w):
        work = torch.empty(BLOCK_BYTES // 4)
        return [encode_expert(w, p, opts.method, work) for p in precisions]

    with _one_torch_thread(), ThreadPoolExecutor(threads) as pool:
        list(pool.map(job, ws[:threads]))  # warm-up
        t0 = time.perf_counter()
        list(pool.map(job, ws))
        seconds = time.perf_counter() - t0
    return {"gb_per_s": nbytes / seconds / GB, "experts": experts, "threads": threads, "load": load()}


def run_scale(cfg: ScaleConfig, workdir: Path) -> dict[str, Any]:
    from ..footprint import memory_need

    workdir.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}
    result: dict[str, Any] = {"config": config,
                              "cpus": os.cpu_count(), "started_load": load()}
    if cfg.convert:
        result["disk"] = measure_disk(cfg.store.parent, cfg.disk_probe_bytes, cfg.drop_caches)
        print(f"scale: disk write {result['disk']['write_gb_per_s']:.2f} GB/s, read "
              f"{result['disk']['read_gb_per_s']:.2f} GB/s", flush=True)
        result["encoder"] = measure_encoder(cfg.model, cfg.convert_opts)
        print(f"scale: encoder {result['encoder']['gb_per_s']:.3f} GB/s", flush=True)
        dropped = _drop(cfg)
        spec = {"label": "convert", "model": str(cfg.model), "store": str(cfg.store),
                "opts": asdict(cfg.convert_opts)}
        result["convert"] = r = run_confined("convert", spec, cfg.convert_limit, workdir, cfg.timeout_s)
        r["page_cache_dropped"] = dropped[0]
        print(f"scale: convert {_convert_line(r)}", flush=True)
    result["runs"] = []
    for budget in cfg.budgets:
        need = memory_need(cfg.store, budget, cfg.dtype, cfg.prompt_tokens + cfg.decode_tokens)
        dropped = _drop(cfg)
        spec = {"label": f"{budget}", "store": str(cfg.store), "budget": budget, "policy": cfg.policy,
                "dtype": cfg.dtype, "prompt_tokens": cfg.prompt_tokens, "decode_tokens": cfg.decode_tokens,
                "threads": cfg.threads, "fetch_workers": cfg.fetch_workers}
        r = run_confined("run", spec, need.total, workdir, cfg.timeout_s)
        r.update(budget_bytes=budget, need=asdict(need) | {"total": need.total}, page_cache_dropped=dropped[0])
        r["within_need"] = "peak_rss_bytes" in r and r["peak_rss_bytes"] <= need.total
        print(f"scale: budget {budget / GB:g} GB: {_run_line(r)}", flush=True)
        result["runs"].append(r)
    return result


def _drop(cfg: ScaleConfig) -> tuple[bool, str]:
    return drop_page_cache() if cfg.drop_caches else (False, "page cache left as it was")


def _convert_line(r: dict) -> str:
    if "error" in r:
        return r["error"]
    return (f"{r['source_bytes'] / GB:.2f} GB in {r['seconds']:.0f} s = {r['gb_per_s']:.3f} GB/s, peak RSS "
            f"{r['peak_rss_bytes'] / GB:.2f} GB, cgroup peak {r.get('peak_bytes', 0) / GB:.2f} GB under a "
            f"{r['limit_bytes'] / GB:.1f} GB cap, OOM kills {r.get('oom_kills')}")


def _run_line(r: dict) -> str:
    if "error" in r:
        return r["error"]
    return (f"prefill {r['prefill_tps']:.2f} tok/s, decode {r['decode_tps']:.2f} tok/s, hit rate "
            f"{r['decode_hit_rate']:.1%}, {r['decode_mb_read_per_token']:.1f} MB/token, peak RSS "
            f"{r['peak_rss_bytes'] / GB:.2f} GB (cap {r['limit_bytes'] / GB:.2f} GB), OOM kills {r.get('oom_kills')}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        sys.exit(child_main(sys.argv[2], sys.argv[3]))
    sys.exit("usage: python -m fate_edge.bench.scale --child convert|run SPEC (started by run_scale)")
