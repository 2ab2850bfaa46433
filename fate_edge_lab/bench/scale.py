"""fate-edge at a real model's size: convert a full-size checkpoint inside a memory cgroup, then run
the store at a few expert budgets from the raw disk (page cache dropped), each run in a process confined by a
memory cgroup to what fate-edge says it needs (``footprint.memory_need``). ``fate-edge bench-scale`` runs it
(``scale_cli``).

Every measurement runs in a fresh child (``python -m fate_edge_lab.bench.scale --child KIND SPEC``) so its peak RSS
is its own; the parent owns the cgroups, drops the page cache and records the load average beside each number.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fate_edge.format.convert import ConvertOptions
from fate_edge.format.store_files import STORE_FILE
from fate_edge_lab.bench.host import cpu_model, load_average
from fate_edge_lab.bench.peers import _memory_cgroup
from fate_edge_lab.bench.prepare import drop_page_cache

GB = 1e9


@dataclass
class ScaleConfig:
    model: Path  # Hugging Face checkpoint at real shapes (fate-edge synth --like ...)
    store: Path  # where the expert store is (or will be) written
    budgets: list[int] = field(default_factory=lambda: [int(2 * GB), int(4 * GB)])  # expert budgets
    convert: bool = True  # convert first (else the store must exist)
    convert_limit: int = int(2 * GB)  # the convert child's memory cap
    # int4 experts only, resident weights as in the checkpoint: the runs quantize them at load (resident_bits)
    convert_opts: ConvertOptions = field(
        default_factory=lambda: ConvertOptions(keep_bf16=False, resident_bits=None, embedding_bits=None)
    )
    policy: str = "fate-edge"
    dtype: str = "bfloat16"  # resident weights and activations
    prompt_tokens: int = 64
    decode_tokens: int = 16
    threads: int = 2  # torch threads of the run child
    fetch_workers: int = 2
    timeout_s: float = 3600.0
    drop_caches: bool = True  # drop the page cache before each measurement (root); off: reads may hit it
    disk_probe_bytes: int = int(1 * GB)  # written and read back to measure the disk
    resident_bits: int | None = None  # quantize the resident weights at load (8 or 4; None: ``dtype``)
    gguf: Path | None = None  # llama.cpp q4_0 GGUF of the same checkpoint: run it memory-mapped beside us
    rounds: int = 1  # interleaved rounds (fate-edge, llama.cpp per budget in each); medians over them
    llama_repack: bool = False  # llama.cpp's Q4_0 repack copies the weights into RAM: off keeps them mapped
    cap_bytes: int | None = None  # one cgroup cap for both sides (0.75 of llama.cpp's file, say); None: our need


def _cgroup_stats(cg: Path) -> dict[str, Any]:
    """Peak charge and OOM kills of a cgroup (v1 or v2)."""
    out: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        if (cg / "memory.max_usage_in_bytes").exists():  # v1
            out["peak_bytes"] = int((cg / "memory.max_usage_in_bytes").read_text())
            oom = dict(ln.split() for ln in (cg / "memory.oom_control").read_text().splitlines())
            out["oom_kills"] = int(oom.get("oom_kill", 0))
            out["limit_hits"] = int((cg / "memory.failcnt").read_text())  # charges that met the cap
        else:  # v2
            if (cg / "memory.peak").exists():
                out["peak_bytes"] = int((cg / "memory.peak").read_text())
            events = dict(ln.split() for ln in (cg / "memory.events").read_text().splitlines())
            out["oom_kills"] = int(events.get("oom_kill", 0))
            out["limit_hits"] = int(events.get("max", 0))  # charges that met the cap and had to reclaim first
    return out


def run_confined(
    kind: str, spec: dict, limit: int, workdir: Path, timeout_s: float, command: list[str] | None = None
) -> dict[str, Any]:
    """Run child ``kind`` on ``spec`` in a fresh memory cgroup capped at ``limit`` bytes; its result plus the
    cgroup's peak charge, OOM kills and the load average before and after. ``command``: run that instead
    (a child printing its result as its last JSON line, as ``sidebyside.child_main`` does)."""
    spec_path = workdir / f"scale-{kind}-{spec.get('label', '')}.json"
    spec_path.write_text(json.dumps(spec))
    result_path = Path(str(spec_path) + ".result.json")
    result_path.unlink(missing_ok=True)
    cg, note = _memory_cgroup(limit)
    procs = None if cg is None else cg / ("cgroup.procs" if (cg / "cgroup.procs").exists() else "tasks")
    info: dict[str, Any] = {"limit_bytes": limit, "cgroup": note, "load_before": load_average()}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            command or [sys.executable, "-m", "fate_edge_lab.bench.scale", "--child", kind, str(spec_path)],
            timeout=timeout_s,
            stdout=subprocess.PIPE,
            stderr=None,
            text=True,
            preexec_fn=(lambda: procs.write_text(str(os.getpid()))) if procs else None,
        )
        info["returncode"] = proc.returncode
        printed = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if command and proc.returncode == 0 and printed:
            result_path.write_text(printed[-1])
    except subprocess.TimeoutExpired:
        info["returncode"] = None
        info["error"] = f"timed out after {timeout_s:.0f}s"
    info["wall_s"] = time.perf_counter() - t0
    info["load_after"] = load_average()
    if cg is not None:
        info.update(_cgroup_stats(cg))
        with contextlib.suppress(OSError):
            cg.rmdir()
    if result_path.exists():
        info.update(json.loads(result_path.read_text()))
    elif "error" not in info:
        info["error"] = f"child exited {info['returncode']} without a result" + (
            " (killed by the OOM killer)" if info.get("oom_kills") else ""
        )
    return info


# ----------------------------------------------------------------------------------------------- children
def _rss(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    return 0


def prompt_ids(store: str | Path, n: int) -> list[int]:
    """The benchmark prompt's first ``n`` token ids (both sides get these ids, not the text)."""
    from fate_edge.tokenizer import Tokenizer

    text = " ".join(["The expert cache streams weights from the disk while the model decodes."] * 64)
    return Tokenizer(store).encode(text)[:n]


def convert_child(spec: dict) -> dict[str, Any]:
    """``fate-edge convert`` with a progress log: (seconds, bytes) samples and this process's peak RSS."""
    from fate_edge.format.convert import convert

    opts = ConvertOptions(**spec["opts"] | {"force": True})
    t0 = time.perf_counter()
    samples: list[tuple[float, int]] = []

    def on_progress(done: int, total: int) -> None:
        now = time.perf_counter() - t0
        if not samples or now - samples[-1][0] >= 1.0 or done == total:
            samples.append((round(now, 2), done))

    convert(spec["model"], spec["store"], opts, progress=sys.stderr.isatty(), on_progress=on_progress)
    seconds = time.perf_counter() - t0
    total = samples[-1][1] if samples else 0
    written = sum(f.stat().st_size for f in Path(spec["store"]).iterdir() if f.is_file())
    return {
        "seconds": seconds,
        "source_bytes": total,
        "written_bytes": written,
        "gb_per_s": total / seconds / GB,
        "peak_rss_bytes": _rss("VmHWM"),
        "progress": samples,
    }


def run_child(spec: dict) -> dict[str, Any]:
    """One request on the store at one budget from a cold page cache: prefill and decode speed, hit rate,
    bytes read per token, peak RSS next to the resident weights and the baseline measured before loading."""
    import torch

    baseline = _rss("VmRSS")  # interpreter + torch + fate_edge imported, nothing loaded
    from fate_edge.runtime.engine import Engine
    from fate_edge.runtime.engine_config import EngineConfig
    from fate_edge.runtime.generate import GenerateConfig
    from fate_edge_lab.bench.llamacpp import read_bytes
    from fate_edge_lab.bench.worker import _stats_dict, _sum_stats

    torch.set_num_threads(spec["threads"])
    ids = spec.get("ids") or prompt_ids(spec["store"], spec["prompt_tokens"])
    t0 = time.perf_counter()
    engine = Engine(
        EngineConfig(
            spec["store"],
            spec["budget"],
            spec["policy"],
            dtype=spec["dtype"],
            workers=spec["fetch_workers"],
            direct_io=True,
            resident_bits=spec.get("resident_bits"),
        )
    )
    load_s = time.perf_counter() - t0
    resident = sum(t.numel() * t.element_size() for t in engine.model.w.values())
    try:
        times: list[float] = []
        steps = []
        io: list[int | None] = []
        for step in engine.stream(ids, GenerateConfig(max_tokens=spec["decode_tokens"] + 1, ignore_eos=True)):
            times.append(time.perf_counter())
            io.append(read_bytes())
            steps.append(step)
        last = steps[-1]
        decode = _sum_stats(engine.token_stats)
        n_dec = len(engine.token_stats)
        pre = engine.prefill_stats
        out = {
            "load_s": load_s,
            "resident_bytes": resident,
            "baseline_rss_bytes": baseline,
            "prompt_tokens": len(ids),
            "prefill_tps": last.prompt_tps,
            "decode_tokens": n_dec,
            "decode_tps": n_dec / (times[-1] - times[0]) if n_dec > 0 else None,
            "decode_hit_rate": decode.hit_rate,
            "prefill_hit_rate": pre.hit_rate,
            "decode_mb_read_per_token": (decode.demand_bytes + decode.prefetch_bytes) / max(n_dec, 1) / 1e6,
            # what the kernel says this process read (/proc/self/io), as the llama.cpp side is measured
            "decode_read_mb_per_token": None
            if io[0] is None or io[-1] is None
            else (io[-1] - io[0]) / max(n_dec, 1) / 1e6,
            "tokens": [s.token for s in steps],
            "prefill_mb_read": (pre.demand_bytes + pre.prefetch_bytes) / 1e6,
            "decode": _stats_dict(decode),
            "prefill": _stats_dict(pre),
            "plan": {
                "cache_bytes": engine.plan.cache_bytes,
                "pool_bytes": engine.plan.pool_bytes,
                "entry_bytes": engine.plan.entry_bytes,
            },
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
    return {
        "write_gb_per_s": n / write_s / GB,
        "read_gb_per_s": n / read_s / GB,
        "page_cache_dropped": dropped,
        "bytes": n,
        "load": load_average(),
    }


def measure_encoder(model: Path, opts: ConvertOptions, experts: int = 24, threads: int | None = None) -> dict:
    """The encoder alone (experts already in memory) on ``threads`` workers, in GB/s of checkpoint bytes."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from fate_edge.quant.rtn import BLOCK_BYTES

    from fate_edge.format.checkpoint import CheckpointReader
    from fate_edge.format.checkpoint_experts import ExpertLayout
    from fate_edge.format.checkpoint_layout import layer_names
    from fate_edge.format.convert import _one_torch_thread, _precisions, with_groups
    from fate_edge.format.store import encode_expert
    from fate_edge.model.arch import load_config

    cfg = load_config(model)
    reader = CheckpointReader(model)
    layout = ExpertLayout(reader, layer_names(cfg, reader)[cfg.moe_layers[0]].mlp)
    precisions = _precisions(cfg, with_groups(opts, (cfg.hidden_size, cfg.moe_intermediate_size)))
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
    return {"gb_per_s": nbytes / seconds / GB, "experts": experts, "threads": threads, "load": load_average()}


def run_scale(cfg: ScaleConfig, workdir: Path) -> dict[str, Any]:
    from fate_edge.runtime.footprint import memory_need

    workdir.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}
    result: dict[str, Any] = {
        "config": config,
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "started_load": load_average(),
    }
    if cfg.convert:
        result["disk"] = measure_disk(cfg.store.parent, cfg.disk_probe_bytes, cfg.drop_caches)
        print(
            f"scale: disk write {result['disk']['write_gb_per_s']:.2f} GB/s, read "
            f"{result['disk']['read_gb_per_s']:.2f} GB/s",
            flush=True,
        )
        result["encoder"] = measure_encoder(cfg.model, cfg.convert_opts)
        print(f"scale: encoder {result['encoder']['gb_per_s']:.3f} GB/s", flush=True)
        dropped = _drop(cfg)
        spec: dict[str, Any] = {
            "label": "convert",
            "model": str(cfg.model),
            "store": str(cfg.store),
            "opts": asdict(cfg.convert_opts),
        }
        result["convert"] = r = run_confined("convert", spec, cfg.convert_limit, workdir, cfg.timeout_s)
        r["page_cache_dropped"] = dropped[0]
        print(f"scale: convert {_convert_line(r)}", flush=True)
    result["runs"], result["llama"] = [], []
    if (cfg.store / STORE_FILE).exists():  # what the store holds, for the table's note
        result["store_embedding_bits"] = json.loads((cfg.store / STORE_FILE).read_text()).get("embedding_bits")
    ids = prompt_ids(cfg.store, cfg.prompt_tokens) if cfg.budgets else []
    for rnd in range(cfg.rounds):
        for budget in cfg.budgets:
            need = memory_need(cfg.store, budget, cfg.dtype, cfg.prompt_tokens + cfg.decode_tokens, cfg.resident_bits)
            spec = {
                "label": f"{budget}",
                "store": str(cfg.store),
                "budget": budget,
                "policy": cfg.policy,
                "dtype": cfg.dtype,
                "prompt_tokens": cfg.prompt_tokens,
                "decode_tokens": cfg.decode_tokens,
                "threads": cfg.threads,
                "fetch_workers": cfg.fetch_workers,
                "resident_bits": cfg.resident_bits,
                "ids": ids,
            }
            dropped = _drop(cfg)
            cap = cfg.cap_bytes or need.total
            r = run_confined("run", spec, cap, workdir, cfg.timeout_s)
            r.update(
                budget_bytes=budget, need=asdict(need) | {"total": need.total}, page_cache_dropped=dropped[0], round=rnd
            )
            r["within_need"] = "peak_rss_bytes" in r and r["peak_rss_bytes"] <= need.total
            print(f"scale: round {rnd + 1} budget {budget / GB:g} GB: {_run_line(r)}", flush=True)
            result["runs"].append(r)
            if cfg.gguf is not None:
                result["llama"].append(run_llama(cfg, ids, budget, cap, workdir, rnd))
    result["summary"] = summarize_scale(result["runs"], result["llama"])
    return result


def run_llama(cfg: ScaleConfig, ids: list[int], budget: int, cap: int, workdir: Path, rnd: int) -> dict[str, Any]:
    """llama.cpp on ``cfg.gguf`` memory-mapped (its Q4_0 repack off unless ``cfg.llama_repack``: see
    ``llamacpp.open_llama``), page cache dropped, in a cgroup capped at ``cap`` (the bytes fate-edge was given
    at ``budget``), the same prompt ids and thread count."""
    from fate_edge_lab.bench.sidebyside import child_command

    spec = {
        "label": f"llama-{budget}",
        "kind": "llama.cpp",
        "mode": "limited",
        "gguf": str(cfg.gguf),
        "ids": ids,
        "decode_tokens": cfg.decode_tokens,
        "threads": cfg.threads,
        "repack": cfg.llama_repack,
    }
    dropped = _drop(cfg)
    r = run_confined("llama", spec, cap, workdir, cfg.timeout_s, command=child_command(spec, workdir))
    r.update(budget_bytes=budget, page_cache_dropped=dropped[0], round=rnd)
    if "error" not in r:
        r["within_need"] = r["peak_rss_bytes"] <= cap
    print(f"scale: round {rnd + 1} llama.cpp q4_0 mmap, cap {cap / GB:.2f} GB: {_llama_line(r)}", flush=True)
    return r


def summarize_scale(runs: list[dict[str, Any]], llama: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per budget, each side's medians over its rounds (``sidebyside.summarize``), its cgroup peak and OOM kills,
    and fate-edge / llama.cpp ratios of decode and prefill tok/s."""
    from fate_edge_lab.bench.sidebyside import Side, summarize

    out = []
    for budget in sorted({r["budget_bytes"] for r in runs}):
        sides = [
            Side("fate-edge", "fate-edge", "int4", "int4, streamed", "", "limited"),
            Side("llama.cpp", "llama.cpp", "q4_0", "q4_0, memory-mapped", "", "limited"),
        ]
        by_side = {
            "fate-edge": [r for r in runs if r["budget_bytes"] == budget],
            "llama.cpp": [r for r in llama if r["budget_bytes"] == budget],
        }
        for rs in by_side.values():
            for r in rs:
                r.setdefault("load_avg", (r.get("load_before") or [None])[0])
        rows = summarize(by_side, sides, [("fate-edge", "llama.cpp")])
        for name, rs in by_side.items():
            peaks = [r["peak_bytes"] for r in rs if r.get("peak_bytes") is not None]
            rows[name].update(
                cgroup_peak_bytes=max(peaks) if peaks else None,
                oom_kills=sum(r.get("oom_kills") or 0 for r in rs),
                limit_bytes=rs[0]["limit_bytes"] if rs else None,
            )
        out.append({"budget_bytes": budget, "sides": rows})
    return out


def _drop(cfg: ScaleConfig) -> tuple[bool, str]:
    return drop_page_cache() if cfg.drop_caches else (False, "page cache left as it was")


def _convert_line(r: dict) -> str:
    if "error" in r:
        return r["error"]
    return (
        f"{r['source_bytes'] / GB:.2f} GB in {r['seconds']:.0f} s = {r['gb_per_s']:.3f} GB/s, peak RSS "
        f"{r['peak_rss_bytes'] / GB:.2f} GB, cgroup peak {r.get('peak_bytes', 0) / GB:.2f} GB under a "
        f"{r['limit_bytes'] / GB:.1f} GB cap, OOM kills {r.get('oom_kills')}"
    )


def _llama_line(r: dict) -> str:
    if "error" in r:
        return r["error"] + f" (OOM kills {r.get('oom_kills')})"
    return (
        f"prefill {r['prefill_tps']:.2f} tok/s, decode {r['decode_tps'] or 0:.2f} tok/s, "
        f"{r.get('decode_read_mb_per_token') or 0:.1f} MB read/token, peak RSS {r['peak_rss_bytes'] / GB:.2f} GB, "
        f"cgroup peak {r.get('peak_bytes', 0) / GB:.2f} GB, OOM kills {r.get('oom_kills')}"
    )


def _run_line(r: dict) -> str:
    if "error" in r:
        return r["error"]
    return (
        f"prefill {r['prefill_tps']:.2f} tok/s, decode {r['decode_tps']:.2f} tok/s, hit rate "
        f"{r['decode_hit_rate']:.1%}, {r['decode_mb_read_per_token']:.1f} MB/token, peak RSS "
        f"{r['peak_rss_bytes'] / GB:.2f} GB (cap {r['limit_bytes'] / GB:.2f} GB), OOM kills {r.get('oom_kills')}"
    )


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        sys.exit(child_main(sys.argv[2], sys.argv[3]))
    sys.exit("usage: python -m fate_edge_lab.bench.scale --child convert|run SPEC (started by run_scale)")
