"""Peers on the same checkpoint: transformers + accelerate disk offload, and llama.cpp (llama-cpp-python)
fully in RAM and memory-mapped inside a memory cgroup capped at our own budget."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from fate_edge_lab.bench.config import HEADLINE_BUDGET, BenchConfig
from fate_edge_lab.bench.prepare import drop_page_cache
from fate_edge_lab.bench.worker import child_command


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


def cgroup_joiner(cgroup: Path | None):
    """A preexec_fn moving the child into ``cgroup`` before it execs (None without a cgroup)."""
    if cgroup is None:
        return None
    procs_file = cgroup / ("cgroup.procs" if (cgroup / "cgroup.procs").exists() else "tasks")

    def join_cgroup():  # runs in the child before exec
        procs_file.write_text(str(os.getpid()))

    return join_cgroup


def _run_peer(kind: str, spec: dict, tmp: Path, timeout: float, cgroup: Path | None = None) -> dict:
    spec_path = tmp / f"peer-{kind}-{spec.get('mode', '')}.json"
    spec_path.write_text(json.dumps(spec))
    try:
        proc = subprocess.run(
            child_command("peer", spec_path, llama_cpp=kind == "llama.cpp"),
            capture_output=True,
            text=True,
            timeout=timeout,
            preexec_fn=cgroup_joiner(cgroup),
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s"}
    out = Path(str(spec_path) + ".result.json")
    if proc.returncode != 0 or not out.exists():
        killed = proc.returncode in (-9, 137)
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        return {
            "error": ("killed (out of memory under the cap?)" if killed else f"exit {proc.returncode}")
            + (f": {tail}" if tail else "")
        }
    return json.loads(out.read_text())


def peer_main(spec_path: str) -> int:
    import torch

    from fate_edge.process_memory import peak_rss_bytes

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
            spec["model_dir"],
            dtype=torch.bfloat16,
            device_map="auto",
            max_memory={"cpu": spec["max_memory"]},
            offload_folder=spec["offload_dir"],
        ).eval()
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
        from fate_edge_lab.bench.llamacpp import llama_stream, open_llama, time_tokens

        llm = open_llama(
            spec["gguf"], max(prompts) + spec["decode_tokens"] + 8, spec["threads"], mmap=spec["mode"] == "mmap"
        )
        for n, ids in sorted(prompts.items()):
            want = spec["decode_tokens"] if n == decode_len else 1
            t = time_tokens(llama_stream(llm, ids), n, want)  # prefill includes sampling the first token
            res["prefill_tps"][str(n)] = t["prefill_tps"]
            if n == decode_len and t["decode_tps"] is not None:
                res["decode_tps"], res["tokens"] = t["decode_tps"], t["tokens"]
    res["peak_rss_bytes"] = peak_rss_bytes()
    Path(spec_path + ".result.json").write_text(json.dumps(res))
    return 0


def run_peers(cfg: BenchConfig, hf_dir: Path | None, info: dict, prompts: dict, tmp: Path) -> list[dict]:
    peers: list[dict] = []
    budget = int(HEADLINE_BUDGET * info["int4_expert_bytes_total"])
    cap = info["resident_bytes"] + budget  # resident weights + the same expert budget as our 35% column
    base = {
        "threads": cfg.threads,
        "prompts": {str(k): v for k, v in prompts.items()},
        "decode_tokens": cfg.decode_tokens,
        "drop_caches": cfg.drop_caches,
    }
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
        r = _run_peer(
            "transformers",
            {**base, "kind": "transformers", "model_dir": str(hf_dir), "max_memory": cap, "offload_dir": str(off)},
            tmp,
            cfg.timeout_s,
        )
        shutil.rmtree(off, ignore_errors=True)
        r.update(
            peer="transformers+accelerate",
            mode="disk offload, bf16",
            note=f"device_map=auto, max_memory cpu = {cap / 1e6:.0f} MB (resident + 35% expert budget), "
            "offload_folder on this disk (page cache as the OS leaves it)",
            wall_s=time.perf_counter() - t0,
        )
        print(f"bench: peer transformers+accelerate: {_peer_line(r)}", flush=True)
        peers.append(r)
    # llama.cpp through llama-cpp-python on a GGUF of the same checkpoint (q4_0, converted once and cached)
    gguf, why = _peer_gguf(cfg, hf_dir)
    if why:
        print(f"bench: peer llama.cpp {why}", flush=True)
        peers.append({"peer": "llama.cpp", "skipped": why})
    else:
        for mode in ("ram", "mmap"):
            cg, note = _memory_cgroup(cap)
            try:
                t0 = time.perf_counter()
                r = _run_peer(
                    "llama.cpp", {**base, "kind": "llama.cpp", "gguf": gguf, "mode": mode}, tmp, cfg.timeout_s, cg
                )
            finally:
                if cg is not None:
                    with contextlib.suppress(OSError):
                        cg.rmdir()
            r.update(
                peer="llama.cpp",
                mode="fully in RAM" if mode == "ram" else "memory-mapped",
                note=note,
                wall_s=time.perf_counter() - t0,
            )
            print(f"bench: peer llama.cpp ({mode}): {_peer_line(r)}", flush=True)
            peers.append(r)
    return peers


def _peer_gguf(cfg: BenchConfig, hf_dir: Path | None) -> tuple[str | None, str | None]:
    """(GGUF for the llama.cpp peer, None) or (None, why it is skipped): --gguf, else the checkpoint's q4_0."""
    from fate_edge.errors import FateEdgeError
    from fate_edge_lab.bench.gguf import ensure_ggufs, llama_cpp_missing

    why = llama_cpp_missing()
    if why:
        return None, f"skipped: {why}"
    if cfg.gguf:
        return cfg.gguf, None
    if hf_dir is None:
        return None, "skipped: --model is a store and no --gguf was given; the converter needs the checkpoint"
    try:
        return str(ensure_ggufs(hf_dir, ("q4_0",))["q4_0"]), None
    except FateEdgeError as exc:
        return None, f"skipped: {exc}"


def _peer_line(r: dict) -> str:
    if "error" in r:
        return r["error"]
    pf = ", ".join(f"{n}: {v:.1f}" for n, v in r.get("prefill_tps", {}).items())
    return (
        f"prefill tok/s {pf}; decode {r.get('decode_tps') or 0:.2f} tok/s; "
        f"peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB"
    )
