"""Decode speed under CPU competition: fate-edge with as many torch threads as cores waiting as libgomp does by
default (~3 ms spin), passively, or with a short spin; its library defaults; one thread; and llama.cpp; each with
0, 1 and 2 busy-looping processes beside it (``research/bench_threads.py``).

Every measurement is a fresh interpreter, so each starts OpenMP with its own settings: the old default is
reproduced by importing torch before fate_edge (libgomp reads OMP_WAIT_POLICY when torch loads it, before
fate_edge's ``setdefault``) with the variable removed from the child's environment."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fate_edge.corpus import heldout_source
from fate_edge_lab.bench.gguf import PEER_CMAKE_HINT
from fate_edge_lab.bench.host import load_average
from fate_edge_lab.bench.llamacpp import PROGRESS, llama_child


@dataclass(frozen=True)
class ThreadConfig:
    name: str
    kind: str  # fate-edge | llama.cpp
    threads: int | None  # torch / llama.cpp threads; None: the library's default
    workers: int | None = None  # fate-edge fetch workers; None: the library's default
    omp_default: bool = False  # reproduce the old default: OMP_WAIT_POLICY unset when libgomp starts
    env: tuple[tuple[str, str], ...] = ()  # OpenMP settings as a user would export them (fate_edge keeps them)

    def describe(self) -> str:
        if self.kind == "llama.cpp":
            return f"llama.cpp f32, {self.threads} threads"
        t = "library default" if self.threads is None else self.threads
        w = "library default" if self.workers is None else self.workers
        omp = ", ".join(f"{k}={v}" for k, v in self.env) or (
            "OpenMP variables unset (libgomp spins ~3 ms)" if self.omp_default else "fate_edge's OpenMP default"
        )
        return f"torch threads: {t}, fetch workers: {w}, {omp}"


def configs(cores: int) -> list[ThreadConfig]:
    return [
        ThreadConfig("fate-edge libgomp spin", "fate-edge", cores, 2, omp_default=True),
        ThreadConfig("fate-edge PASSIVE", "fate-edge", cores, 2, env=(("OMP_WAIT_POLICY", "PASSIVE"),)),
        ThreadConfig("fate-edge short spin", "fate-edge", cores, 2, env=(("GOMP_SPINCOUNT", "10000"),)),
        ThreadConfig("fate-edge library default", "fate-edge", None, None),
        ThreadConfig("fate-edge 1 thread", "fate-edge", 1, 1),
        ThreadConfig(f"llama.cpp {cores} threads", "llama.cpp", cores),
        ThreadConfig("llama.cpp 1 thread", "llama.cpp", 1),
    ]


def child_command(spec: dict[str, Any]) -> list[str]:
    """A fresh interpreter measuring ``spec``; torch first when the old OpenMP default is wanted."""
    first = "import torch; " if spec["omp_default"] else ""
    code = f"{first}import sys; from fate_edge_lab.bench.threads import child_main; child_main(sys.argv[1])"
    if spec["kind"] == "llama.cpp":
        code = llama_child(code)
    return [sys.executable, "-c", code, json.dumps(spec)]


def child_env(spec: dict[str, Any]) -> dict[str, str]:
    """This environment without the OpenMP settings fate_edge made, plus the configuration's own."""
    env = dict(os.environ)
    for name in filter(None, env.pop("FATE_EDGE_SET_OPENMP", "").split(",")):
        env.pop(name, None)
    if spec["omp_default"]:
        env.pop("OMP_WAIT_POLICY", None)
    return {**env, **dict(spec["env"])}


def competitor_command(seconds: float) -> list[str]:
    """A CPU-bound process that stops by itself after ``seconds`` (and is killed earlier by the bench)."""
    return [sys.executable, "-c", f"import time\nt = time.time() + {seconds}\nwhile time.time() < t: pass"]


def start_competitors(n: int, seconds: float) -> list[subprocess.Popen]:
    return [subprocess.Popen(competitor_command(seconds)) for _ in range(n)]


def stop_competitors(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def prompt_ids(model_dir: str | Path, n: int) -> list[int]:
    from fate_edge.tokenizer import Tokenizer

    text, _ = heldout_source(n * 16)
    return Tokenizer(model_dir).encode(text)[:n]


def child_main(spec_json: str) -> None:
    """Decode up to ``decode_tokens`` greedy tokens (stopping after ``max_s``); print one JSON line."""
    spec = json.loads(spec_json)
    from fate_edge_lab.bench.llamacpp import llama_stream, open_llama

    ids = spec["ids"]
    if spec["kind"] == "llama.cpp":
        llm = open_llama(spec["gguf"], len(ids) + spec["decode_tokens"] + 8, spec["threads"], mmap=False)
        stream, used = llama_stream(llm, ids), {"threads": spec["threads"]}
    else:
        import torch

        from fate_edge import defaults
        from fate_edge.runtime.engine import Engine
        from fate_edge.runtime.engine_config import EngineConfig
        from fate_edge.runtime.generate import GenerateConfig

        threads = spec["threads"] or defaults.STREAMING_THREADS
        if threads is not None:  # None: torch's own default
            torch.set_num_threads(threads)
        workers = spec["workers"] or defaults.FETCH_WORKERS
        engine = Engine(EngineConfig(spec["store"], spec["budget"], "fate-edge", workers=workers))
        used = {
            "threads": torch.get_num_threads(),
            "workers": engine.fetch.workers,
            **{k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")},
        }
        cfg = GenerateConfig(max_tokens=spec["decode_tokens"] + 1, ignore_eos=True)
        stream = (r.token for r in engine.stream(ids, cfg))
    times = []
    for _ in stream:
        times.append(time.perf_counter())
        if len(times) > spec["decode_tokens"] or times[-1] - times[0] > spec["max_s"]:
            break
    tps = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
    print(json.dumps({"decode_tps": tps, "decode_tokens": len(times) - 1, **used}), flush=True)


def measure(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    return run_child(child_command(spec), timeout, child_env(spec))


def _why_it_died(returncode: int) -> str:
    """What a child's exit status says beyond its number: the signal that ended it, and what that usually means."""
    if returncode in (-9, 137):
        return " (killed: out of memory under the cap?)"
    if returncode in (-4, 132):  # SIGILL, as llama.cpp built with AMX died on a VM whose AMX faults
        return (
            " (SIGILL: the program used an instruction this CPU does not run; rebuild the peer for this host: "
            f'CMAKE_ARGS="{PEER_CMAKE_HINT}")'
        )
    if returncode < 0:
        return f" (signal {signal.Signals(-returncode).name})" if -returncode in signal.valid_signals() else ""
    return ""


def _proc_read_bytes(pid: int) -> int | None:
    """Bytes process ``pid`` caused to be read from storage so far (mapped files' page faults included)."""
    try:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _unfinished(timeout: float, read: int | None, stdout: str) -> dict[str, Any]:
    """A child stopped at ``timeout``: a measured result (how long, what it read, how far it got), not a blank.
    ``progress``: its last ``{"progress": ...}`` line (sidebyside.child_main prints one as each token arrives)."""
    last = [ln for ln in stdout.splitlines() if ln.startswith('{"' + PROGRESS + '"')]
    msg = f"did not finish in {timeout:.0f} s" + ("" if read is None else f", {read / 1e9:.1f} GB read")
    return {
        "error": msg,
        "timed_out_s": timeout,
        "stopped_at": time.time(),
        "read_bytes": read,
        "progress": json.loads(last[-1])[PROGRESS] if last else None,
    }


def run_child(cmd: list[str], timeout: float, env: dict[str, str] | None = None, preexec=None) -> dict[str, Any]:
    """Run a measuring child; its last JSON line on stdout, or {"error": ...} naming how it failed. A child still
    running at ``timeout`` is stopped; what it read by then (``/proc/PID/io``) and how far it got are reported."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        read = _proc_read_bytes(proc.pid)  # before it is gone
        proc.kill()
        stdout, _ = proc.communicate()  # all its output, what came before the timeout included
        return _unfinished(timeout, read, stdout)
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{") and not ln.startswith('{"' + PROGRESS + '"')]
    if proc.returncode != 0 or not lines:
        tail = " | ".join(stderr.strip().splitlines()[-3:])
        return {"error": f"exit {proc.returncode}{_why_it_died(proc.returncode)}: {tail}"}
    return json.loads(lines[-1])


def run(
    base: dict[str, Any], cfgs: list[ThreadConfig], competition: list[int], rounds: int, log=print
) -> list[dict[str, Any]]:
    """Interleaved rounds: for each round, each competition level, each configuration, one fresh measurement."""
    rows: dict[tuple[int, str], dict[str, Any]] = {}
    for r in range(rounds):
        for n in competition:
            for c in cfgs:
                spec = {**base, **asdict(c)}
                procs = start_competitors(n, base["max_s"] + 60)
                try:
                    time.sleep(0.5 if n else 0)  # let the competitors get going
                    load = load_average()
                    res = measure(spec, base["max_s"] + 120)
                finally:
                    stop_competitors(procs)
                row = rows.setdefault(
                    (n, c.name), {"competitors": n, "config": c.name, "describe": c.describe(), "runs": []}
                )
                row["runs"].append({**res, "load_avg": load})
                log(
                    f"round {r + 1} competitors {n} {c.name}: "
                    f"{res.get('decode_tps', 0):.2f} tok/s {res.get('error', '')} (load {load[0]})"
                )
    return list(rows.values())


def summarize(rows: list[dict[str, Any]]) -> None:
    """Median decode tok/s (and load average) of each row's runs, in place."""
    import statistics

    for row in rows:
        ok = [r for r in row["runs"] if "error" not in r]
        row["median_decode_tps"] = statistics.median(r["decode_tps"] for r in ok) if ok else None
        row["median_load_avg"] = statistics.median(r["load_avg"][0] for r in row["runs"])
        row["errors"] = len(row["runs"]) - len(ok)


def table(rows: list[dict[str, Any]], competition: list[int], header: str) -> str:
    names = list(dict.fromkeys(r["config"] for r in rows))
    cell = {(r["competitors"], r["config"]): r for r in rows}
    out = [
        header,
        "",
        "| configuration | " + " | ".join(f"{n} busy processes" for n in competition) + " |",
        "|---|" + "---:|" * len(competition),
    ]
    for name in names:
        cells = []
        for n in competition:
            r = cell[(n, name)]
            v = "failed" if r["median_decode_tps"] is None else f"{r['median_decode_tps']:.1f}"
            cells.append(f"{v} (load {r['median_load_avg']:.1f})")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    out += [""] + [f"- {name}: {cell[(competition[0], name)]['describe']}" for name in names]
    return "\n".join(out)
