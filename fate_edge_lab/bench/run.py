"""The run in phases: routing traces (oracle + reference tokens), link checks, then every configuration in a
fresh process: the headline budget with load-on-demand first, then the peers, then the other budgets."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import itertools
import json
import os
import pickle
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from fate_edge_lab.bench.config import (
    HEADLINE_BUDGET,
    LINKS,
    QUICK_NOTE,
    BenchConfig,
    LinkChoice,
    emulated_choice,
    headline_budget,
)
from fate_edge_lab.bench.peers import run_peers
from fate_edge_lab.bench.prepare import drop_page_cache, make_prompts, prepare_model, store_info, warm_page_cache
from fate_edge_lab.bench.results import add_device_equivalent, compute_ratios, flag_reference_tokens, merge_runs
from fate_edge_lab.bench.worker import child_command, trace_main, worker_main

_CHILD_IDS = itertools.count()


def _run_child(
    mode: str, spec: dict, tmp: Path, timeout: float, isolate: bool = True
) -> tuple[dict | None, str | None]:
    """Run ``python -m fate_edge_lab.bench --<mode> SPEC`` in a fresh process; (result, error).

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
    try:
        proc = subprocess.run(child_command(mode, spec_path), capture_output=True, text=True, timeout=timeout)
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
    from fate_edge.runtime.engine import Engine, Trace
    from fate_edge.runtime.engine_config import EngineConfig
    from fate_edge.runtime.policy import PRESETS

    skipped = {}
    for name in presets:
        if name not in PRESETS:
            skipped[name] = "not a preset of this version (fate_edge.runtime.policy.PRESETS)"
            continue
        try:
            Engine(EngineConfig(store, budget, name, trace=Trace() if name == "oracle" else None)).close()
        except Exception as exc:  # ImportError of a predictor being written, a missing precision, ...
            skipped[name] = f"{type(exc).__name__}: {exc}"
    return skipped


def link_check(store: Path, choice: LinkChoice, n: int = 8) -> dict[str, Any]:
    """Read ``n`` int4 experts one after another through the link: achieved vs specified bandwidth."""
    from fate_edge.planning.emulation import time_reads

    spec = choice.spec()
    if spec is None:
        drop_page_cache()
    nbytes, seconds, io = time_reads(store, spec, choice.reads_direct, n)
    dt = sum(seconds)
    return {
        "spec_gbps": spec.bandwidth_bytes_per_s / 1e9 if spec else None,
        "spec_latency_us": spec.latency_s * 1e6 if spec else None,
        "achieved_gbps": nbytes / dt / 1e9,
        "per_expert_ms": 1e3 * dt / len(seconds),
        "io": io,
    }


def _configs(cfg: BenchConfig, info: dict, presets: list[str]) -> list[dict]:
    from fate_edge.runtime.policy import PRESETS

    out: list[dict[str, Any]] = []
    for link in cfg.links:
        for p in presets:
            if not PRESETS[p].cache:  # load-on-demand: no cache; the budget only has to cover its read buffers
                out.append(
                    {
                        "link": link,
                        "preset": p,
                        "budget_fraction": None,
                        "budget_bytes": int(info["int4_expert_bytes_total"]),
                    }
                )
                continue
            for b in cfg.budgets:
                out.append(
                    {
                        "link": link,
                        "preset": p,
                        "budget_fraction": b,
                        "budget_bytes": int(b * info["int4_expert_bytes_total"]),
                    }
                )
    return out


def compare_with_preset(r: dict, results: list[dict]) -> None:
    """A planned row beside the ``fate-edge`` row of the same link and budget: auto over the preset,
    measured, and the planner's prediction for the preset against the preset's measurement."""
    if r.get("preset") != "planned" or not r.get("median", {}).get("decode_tps"):
        return
    preset = next(
        (
            q
            for q in results
            if q["preset"] == "fate-edge"
            and q["link"] == r["link"]
            and q["budget_fraction"] == r["budget_fraction"]
            and q.get("median", {}).get("decode_tps")
        ),
        None,
    )
    if preset is None:
        return
    measured = preset["median"]["decode_tps"]
    r["preset_decode_tps"] = measured
    r["auto_over_preset"] = r["median"]["decode_tps"] / measured
    predicted = (r.get("planner_preset_predictions") or {}).get("fate-edge")
    if predicted:
        r["preset_predicted_decode_tps"] = predicted
        r["preset_prediction_error"] = predicted / measured - 1
    on_run = r.get("preset_predicted_on_run_routing")
    if on_run:
        r["preset_prediction_error_on_run_routing"] = on_run / measured - 1


def planner_configs(cfg: BenchConfig, store: Path, info: dict, budgets: list[float]) -> tuple[list[dict], str | None]:
    """One ``planned`` configuration per (link, budget). Its worker process runs the planner (probe, simulate,
    choose) and then measures the chosen policy at once, as ``Engine.load(policy="auto")`` would: on a shared host
    whose speed drifts from minute to minute, a plan made minutes before its measurement would be compared
    with a different machine."""
    if not cfg.planner:
        return [], "planner not run (--no-planner)"
    try:
        from fate_edge.planning import planner  # noqa: F401
    except ImportError:
        return [], "fate_edge.planning.planner not present: no predicted tok/s"
    total = info["int4_expert_bytes_total"]
    return [
        {"link": link, "preset": "planned", "budget_fraction": b, "budget_bytes": int(b * total), "run_planner": True}
        for link in cfg.links
        for b in budgets
    ], None


class Phases:
    """Configurations run in phases and rounds, each run in a fresh process (``planned`` ones: see the planner
    hook). With a time limit (--quick), configurations that would start after it are listed as dropped."""

    def __init__(
        self,
        cfg: BenchConfig,
        store: Path,
        info: dict,
        presets: list[str],
        common: dict,
        trace_file: Path,
        tmp: Path,
        t_start: float,
        decode_len: int,
        links: dict[str, LinkChoice],
    ):
        self.cfg, self.store, self.info, self.presets, self.common = cfg, store, info, presets, common
        self.links = links
        self.trace_file, self.tmp, self.t_start, self.decode_len = trace_file, tmp, t_start, decode_len
        self.deadline = t_start + cfg.time_limit_s if cfg.time_limit_s else None
        self.results: list[dict] = []
        self.dropped: list[str] = []
        self.failed_presets: dict[str, str] = {}
        self.planner_notes: list[str] = []
        self.warmed: str | None = None  # the link whose run last warmed the page cache
        self.n = 0

    def past_deadline(self) -> bool:
        return self.deadline is not None and time.perf_counter() > self.deadline

    def run(self, budgets: list[float], with_lod: bool) -> None:
        cfg, deadline, results = self.cfg, self.deadline, self.results
        configs = [
            c
            for c in _configs(cfg, self.info, self.presets)
            if (c["budget_fraction"] is None and with_lod) or c["budget_fraction"] in budgets
        ]
        if deadline is None or time.perf_counter() < deadline:
            planned, note = planner_configs(cfg, self.store, self.info, budgets)
            configs += planned
            if note:
                self.planner_notes.append(note)
        # Rounds: every configuration's run r happens before any configuration's run r + 1, each in a fresh
        # process, so a median samples the host at ``runs`` different times: this shared host's speed drifts
        # over tens of seconds, and back-to-back runs of one configuration would all share one phase.
        done: dict[int, list[dict]] = {}
        for rnd in range(cfg.runs):
            for i, c in enumerate(configs):
                label = f"{c['link']} {c['preset']} " + (
                    f"{100 * c['budget_fraction']:.0f}%" if c["budget_fraction"] is not None else "(no cache)"
                )
                if self.past_deadline():
                    if rnd == 0:
                        self.dropped.append(label)
                    elif i in done:
                        done[i][0].setdefault("note", f"{len(done[i])} of {cfg.runs} runs (time limit)")
                    continue
                if c["preset"] in self.failed_presets or (rnd > 0 and i not in done):
                    if rnd == 0:
                        why = self.failed_presets[c["preset"]]
                        results.append({**c, "error": f"skipped after an earlier failure: {why}"})
                    continue
                res = self.run_one(c, f"{label} (run {rnd + 1}/{cfg.runs})")
                if res is None:
                    done.pop(i, None)
                else:
                    done.setdefault(i, []).append(res)
        for i in sorted(done):
            results.append(merge_runs(done[i], self.decode_len))

    def run_one(self, c: dict, label: str) -> dict | None:
        """One run of configuration ``c`` in its own process; its result, or None (the error is recorded)."""
        cfg = self.cfg
        choice = self.links[c["link"]]
        spec_link = choice.spec()
        if not choice.reads_direct and self.warmed != c["link"]:
            warm_page_cache(self.store)
            self.warmed = c["link"]
        elif choice.reads_direct:
            self.warmed = None
        spec = {
            **self.common,
            **c,
            "runs": 1,
            "drop_caches": cfg.drop_caches,
            "direct_io": choice.reads_direct,
            "link_spec": dataclasses.asdict(spec_link) if spec_link is not None else None,
            # the oracle replays the routing; the planner also predicts the pick over it (the request measured)
            "trace_file": str(self.trace_file) if c["preset"] in ("oracle", "planned") else None,
        }
        t0 = time.perf_counter()
        res, err = _run_child("worker", spec, self.tmp, cfg.timeout_s, cfg.isolate)
        self.n += 1
        label = f"[{self.n}] {label}"
        if err is not None:
            print(f"bench: {label}: FAILED {err}", flush=True)
            self.results.append({**c, "error": err})
            if "BudgetError" not in err:
                self.failed_presets[c["preset"]] = err
            return None
        assert res is not None  # a child gives its result or an error
        m = res["median"]
        pf = " ".join(f"{n}:{v:.1f}" for n, v in m["prefill_tps"].items())
        print(
            f"bench: {label}: decode {m['decode_tps'] or 0:.2f} tok/s, prefill {pf} tok/s, hit "
            f"{100 * (m['hit_rate'] or 0):.0f}%, stall {m['stall_ms_per_token'] or 0:.1f} ms/tok, "
            f"{m['mb_read_per_token'] or 0:.2f} MB/tok, RSS {res['peak_rss_bytes'] / 2**20:.0f} MiB "
            f"({time.perf_counter() - t0:.0f}s; {time.perf_counter() - self.t_start:.0f}s total)"
            + (
                f"; planner predicted {res['planner_predicted_decode_tps']:.2f} decode tok/s"
                if res.get("planner_predicted_decode_tps")
                else ""
            ),
            flush=True,
        )
        return res


def record_traces(
    cfg: BenchConfig, common: dict, info: dict, trace_file: Path, tmp: Path, decode_len: int
) -> tuple[list[int] | None, str | None]:
    """Phase 1: each request's routing trace (for the oracle) and the int4 reference tokens, in a process of
    its own; (reference tokens of the decode request, error)."""
    t0 = time.perf_counter()
    _, err = _run_child(
        "trace",
        {**common, "trace_file": str(trace_file), "int4_total": info["int4_expert_bytes_total"]},
        tmp,
        cfg.timeout_s,
        cfg.isolate,
    )
    if err is not None:
        return None, err
    with open(trace_file, "rb") as f:
        reference = pickle.load(f)["tokens"].get(decode_len)
    print(f"bench: recorded routing traces ({time.perf_counter() - t0:.1f}s)", flush=True)
    return reference, None


def check_links(cfg: BenchConfig, store: Path, links: dict[str, LinkChoice]) -> dict[str, Any]:
    """Phase 2, link calibration: what each emulated link achieves on this machine."""
    links_out = {}
    for key in cfg.links:
        choice = links[key]
        spec = choice.spec()
        if not choice.reads_direct:
            warm_page_cache(store)
        try:
            check = link_check(store, choice)
        except Exception as exc:  # noqa: BLE001
            check = {"error": f"{type(exc).__name__}: {exc}"}
        links_out[key] = {
            "title": choice.title,
            "profile": choice.profile,
            "kind": choice.kind,
            "source": choice.source,
            "name": spec.name if spec else "raw disk",
            "check": check,
            "dilation": choice.dilation,
        }
        print(f"bench: link {key}: {json.dumps(check)}", flush=True)
    return links_out


def calibrate_emulation(cfg: BenchConfig, store: Path, prompt: list[int]):
    """k for ``cfg.emulate`` on this host, with the torch threads the configurations run with."""
    import torch

    from fate_edge.planning.emulation import calibrate, store_side

    assert cfg.emulate is not None  # only an emulated bench calibrates
    before = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        em = calibrate(
            cfg.emulate,
            store,
            prompt[:32],
            workers=cfg.fetch_workers,
            host_s_per_token=cfg.emulate_host_ms / 1e3 if cfg.emulate_host_ms else None,
            side=store_side(store, resident_bits=cfg.resident_bits),
        )
    finally:
        torch.set_num_threads(before)
    print(
        f"bench: emulating {em.profile}: host {em.host_s_per_token * 1e3:.1f} ms / device "
        f"{em.device_s_per_token * 1e3:.2f} ms per token (roofline) = k {em.k:.3g}; link "
        f"{em.emulated.name} at {em.emulated.bandwidth_bytes_per_s / 1e9:.4g} GB/s; {em.io_note}",
        flush=True,
    )
    return em


def code_commit() -> str | None:
    """The git commit of the code running, where it runs from a checkout (an installed wheel has none)."""
    with contextlib.suppress(Exception):
        return (
            subprocess.run(
                ["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            or None
        )
    return None


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """The whole benchmark (see the package docstring); returns the result that write_outputs saves."""
    import torch

    t_start = time.perf_counter()
    store, hf_dir, model_desc = prepare_model(cfg)
    info = store_info(store)
    prompts, files = make_prompts(store, sorted(cfg.prompt_tokens))
    decode_len = min(prompts)
    if hf_dir is not None:
        print(f"bench: checkpoint {hf_dir}", flush=True)
    print(
        f"bench: model {model_desc}; int4 experts total {info['int4_expert_bytes_total'] / 1e6:.1f} MB; "
        f"prompts {sorted(prompts)} tokens from held-out stdlib source ({', '.join(files[:3])}"
        f"{', ...' if len(files) > 3 else ''}); {cfg.threads} torch threads",
        flush=True,
    )
    if cfg.quick:
        print(f"bench: {QUICK_NOTE}", flush=True)

    skipped = preflight(store, cfg.presets, int(HEADLINE_BUDGET * info["int4_expert_bytes_total"]))
    for name, why in skipped.items():
        print(f"bench: skipping preset {name}: {why}", flush=True)
    presets = [p for p in cfg.presets if p not in skipped]

    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="fate-bench-", dir=out_dir))
    common = {
        "store": str(store),
        "threads": cfg.threads,
        "fetch_workers": cfg.fetch_workers,
        "device": cfg.device,
        "prompts": {str(k): v for k, v in prompts.items()},
        "decode_tokens": cfg.decode_tokens,
        "emulate": cfg.emulate,  # fate-edge runs as on the emulated device (device_presets.py)
        "resident_bits": cfg.resident_bits,
    }

    links, emulation = dict(LINKS), None
    if cfg.emulate:  # device-faithful emulation: the device's link, dilated by the host/device compute ratio
        emulation = calibrate_emulation(cfg, store, prompts[decode_len])
        choice = emulated_choice(emulation)
        links[choice.key] = choice
        cfg.links = [choice.key]

    # 1. the routing trace of each request (oracle) and the int4 reference tokens
    trace_file = tmp / "traces.pkl"
    reference, err = record_traces(cfg, common, info, trace_file, tmp, decode_len)
    if err is not None:
        print(f"bench: trace recording failed ({err}); skipping oracle", flush=True)
        if "oracle" in presets:
            presets.remove("oracle")
            skipped["oracle"] = f"trace recording failed: {err}"

    # 2. link calibration
    links_out = check_links(cfg, store, links)

    # 3. every configuration in a fresh process. Phase 1 is the headline budget (and load-on-demand); then the
    # peers; then the other budgets, farthest from the headline first.
    hb = headline_budget(cfg.budgets)
    rest = sorted((b for b in cfg.budgets if b != hb), key=lambda b: -abs(b - hb))
    phases = Phases(cfg, store, info, presets, common, trace_file, tmp, t_start, decode_len, links)
    phases.run([hb], with_lod=True)
    # 4. peers
    if not cfg.peers:
        peers = [{"skipped": "--no-peers"}]
    elif phases.past_deadline():
        peers = [{"skipped": "--quick time limit reached before the peers"}]
        phases.dropped.append("peers")
    else:
        peers = run_peers(cfg, hf_dir, info, prompts, tmp)
    phases.run(rest, with_lod=False)
    results, dropped = phases.results, phases.dropped
    if dropped:
        print(f"bench: dropped by the time limit ({cfg.time_limit_s:.0f}s): {', '.join(dropped)}", flush=True)

    compute_ratios(results)
    add_device_equivalent(results, {key: c.dilation for key, c in links.items() if c.dilation})
    flag_reference_tokens(results, reference)
    for r in results:
        if r.get("planner_predicted_decode_tps") and r.get("median", {}).get("decode_tps"):
            r["planner_error"] = r["planner_predicted_decode_tps"] / r["median"]["decode_tps"] - 1
        if r.get("planner_predicted_on_run_routing") and r.get("median", {}).get("decode_tps"):
            r["planner_error_on_run_routing"] = r["planner_predicted_on_run_routing"] / r["median"]["decode_tps"] - 1
        compare_with_preset(r, results)
    planner_note = "; ".join(dict.fromkeys(phases.planner_notes)) or None
    shutil.rmtree(tmp, ignore_errors=True)
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": code_commit(),
        "command": cfg.command,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "threads": {"torch": cfg.threads, "fetch_workers": cfg.fetch_workers},
        "quick": cfg.quick,
        "quick_note": QUICK_NOTE if cfg.quick else None,
        "config": dataclasses.asdict(cfg),
        "model": {"description": model_desc, "checkpoint": str(hf_dir) if hf_dir else None, **info},
        "prompts": {
            "lengths": sorted(prompts),
            "decode_tokens": cfg.decode_tokens,
            "source_files": files,
            "decode_prompt": decode_len,
            "greedy": True,
        },
        "links": links_out,
        "emulation": emulation.to_dict() if emulation else None,
        "skipped_presets": skipped,
        "dropped_by_time_limit": dropped,
        "planner": planner_note,
        "int4_reference_tokens": reference,
        "results": results,
        "peers": peers,
        "wall_s": time.perf_counter() - t_start,
    }
