"""Short emulated runs of fate-edge as resolved per device, against the host preset, lru, fate and the oracle.

For each device: k pinned by --host-ms or by the median of --host-probes planner probes (the same for every run
compared), the device's link dilated by k, O_DIRECT reads where the emulation says so; every policy runs the same
prompt (the planner's sample text) and decodes the same greedy tokens, in interleaved rounds; medians; beside them
each run's own host compute per token, which the dilation assumes equals the pinned one. Beside each measured
figure, the simulator's prediction on the sweep's recorded trace (research/sweep_device_presets.py --trace), the
planner's view of that device.
Device-equivalent tok/s = raw x k. A second table puts the host's drift aside: each run's decode re-timed with its
host compute replaced by the device's (the roofline token, as the simulator has it), keeping what the run measured
of its own on the dilated link, scaled by 1/k: stall, blob decode and prediction ("compute-normalised"). It still
assumes the host computed k x the device's time while reads travelled (a run that computed faster gave its reads ahead
less time than a device would), and it leaves out what reads beside compute cost the host's compute, which a
device's DMA does not cost its GPU.
Optionally rewrites the table between <!-- MARK:begin/end --> of docs/results/MARK.md (--results, --mark).

    python research/validate_device_presets.py --host-ms 17 --trace /tmp/emul_trace.pkl --devices orin-nano
"""

from __future__ import annotations

import argparse
import copy
import json
import pickle
import statistics
import sys
import time
from pathlib import Path

import torch
from fate_edge.devices.link import ThrottledLink

from fate_edge.format.store import ExpertStore
from fate_edge.planning.device_costs import DEVICES
from fate_edge.planning.device_presets import for_device, for_device_and_store
from fate_edge.planning.emulation import calibrate, host_token_seconds, store_side
from fate_edge.planning.host_costs import token_compute_s
from fate_edge.planning.plan_trace import sample_token_ids
from fate_edge.planning.simulate import scale_costs
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge.runtime.generate import GenerateConfig
from fate_edge.runtime.policy import PRESETS, PolicyConfig
from fate_edge.tokenizer import Tokenizer
from fate_edge_lab.bench.publish import add_results_arg, replace_between_markers, results_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep_device_presets import sim  # noqa: E402

MARK = "device-presets"


def sweep_best(path: str | None, device: str, budget: float) -> dict:
    """{label: policy} of the sweep's best candidate for ``device`` at ``budget`` (its JSON), or nothing."""
    if path is None:
        return {}
    found = json.loads(Path(path).read_text())["devices"].get(device, {}).get("budgets", {}).get(str(budget))
    if not found:
        return {}
    return {f"sweep best ({found['best']})": PolicyConfig(**found["best_policy"])}


def policies(device: str, lod: bool, store: str, resident_bits: int | None) -> dict:
    base = (
        {"load-on-demand (bf16)": PRESETS["load-on-demand"], "load-on-demand-int4": PRESETS["load-on-demand-int4"]}
        if lod
        else {}
    )
    dev = for_device_and_store(PRESETS["fate-edge"], device, store, resident_bits)  # the row for this model
    bound = for_device(PRESETS["fate-edge"], device)  # the link-bound row, whatever the model
    rows = {"fate-edge": dev} if dev == bound else {"fate-edge (link-bound row)": bound, "fate-edge": dev}
    return {
        **base,
        "lru": PRESETS["lru"],
        "fate": PRESETS["fate"],
        "fate-edge (host preset)": PRESETS["fate-edge"],
        **rows,
        "oracle": PRESETS["oracle"],
    }


def first_tokens(trace, n: int):
    """``trace`` cut to its first ``n`` decode tokens (the sweep records more than a short run decodes)."""
    out = copy.copy(trace)
    out.expert_ids = {layer: v[:n] for layer, v in trace.expert_ids.items()}
    out.predictions = {name: {key: v[:n] for key, v in scores.items()} for name, scores in trace.predictions.items()}
    return out


def normalised_tps(token_stats: list, device_s: float, k: float) -> float:
    """Decode tok/s with each token's host compute replaced by ``device_s`` (the device's roofline token) and the
    rest of it, what the run measured on the k-dilated timeline (stall, blob decode, prediction), scaled by 1 / k."""
    total = sum(device_s + (s.stall_s + s.consume_s + s.predict_s) / k for s in token_stats)
    return len(token_stats) / total if total > 0 else 0.0


def run_once(
    store: str, budget: int, policy, em, ids: list[int], decode: int, trace, resident_bits: int | None = None
) -> dict:
    eng = Engine(
        EngineConfig(
            store,
            budget,
            policy,
            link=ThrottledLink(em.emulated),
            trace=trace,
            workers=1,
            direct_io=em.direct_io,
            resident_bits=resident_bits,
        )
    )
    try:
        times, last = [], None
        for step in eng.stream(ids, GenerateConfig(max_tokens=decode + 1, ignore_eos=True)):
            times.append(time.perf_counter())
            last = step
        assert last is not None
        st = eng.token_stats
        # The planner probe's measure of host compute (token time less stall and blob decoding), in this run:
        # the dilation assumes it equals the pinned host token, so a gap shows up as simulator error.
        compute = token_compute_s(times, st)
        uses = sum(s.hits + s.prefetch_hits + s.misses for s in st)
        nbytes = sum(s.demand_bytes + s.prefetch_bytes + s.wasted_bytes for s in st)
        pf = eng.prefill_stats
        return {
            "decode_tps": len(st) / (times[-1] - times[0]),
            "prefill_tps": last.prompt_tps,
            "prefill_mb": (pf.demand_bytes + pf.prefetch_bytes + pf.wasted_bytes) / 1e6,
            "host_ms": 1e3 * statistics.median(compute),
            "normalised_tps": normalised_tps(st, em.device_s_per_token, em.k),
            "hit_rate": sum(s.hits + s.prefetch_hits for s in st) / max(1, uses),
            "mb_per_token": nbytes / 1e6 / max(1, len(st)),
        }
    finally:
        eng.close()


def ratio(r: dict, ref: dict | None, key: str = "decode_tps") -> str:
    return f"{r[key] / ref[key]:.2f}x" if ref else "—"


def probes(d: dict) -> str:
    """The pinned host token's probes, when it was measured here rather than given."""
    got = d.get("host_ms_probes")
    return f" (host: median of probes {' / '.join(f'{x:.1f}' for x in got)} ms)" if got else ""


def table(results: dict) -> str:
    lines = []
    for d in results.values():
        pols = d["policies"]
        lod, lod4, fate = (pols.get(n) for n in ("load-on-demand (bf16)", "load-on-demand-int4", "fate"))
        held = "" if d.get("resident_bits") is None else f"int{d['resident_bits']} resident linears, "
        lines += [
            f"**{d['profile']}** (emulated: k = {d['k']:.3g}, host {d['host_ms']:.1f} ms pinned, device "
            f"{d['device_ms']:.2f} ms per token{probes(d)}; {held}{d['rounds']} interleaved rounds, medians; "
            f"load {d['load']}; device-equivalent = raw x k)",
            "",
            "| policy | device-eq. decode tok/s | simulated (device-eq.) | sim error | device-eq. prefill tok/s "
            "| prefill MB read | hit rate | MB read / token | host ms / token in run "
            "| x LOD bf16 decode / prefill | x LOD int4 | x fate | oracle / this |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        oracle = pols["oracle"]["decode_tps"]
        for name, r in pols.items():
            err = r["sim_tps"] / r["decode_tps"] - 1
            lines.append(
                f"| {name} | {r['decode_tps']:.0f} | {r['sim_tps']:.0f} | {err:+.0%} | {r['prefill_tps']:.0f} "
                f"| {r['prefill_mb']:.0f} | {r['hit_rate']:.0%} | {r['mb_per_token']:.1f} "
                f"| {r['host_ms']:.1f} "
                f"| {ratio(r, lod)} / {ratio(r, lod, 'prefill_tps')} | {ratio(r, lod4)} | {ratio(r, fate)} "
                f"| {oracle / r['decode_tps']:.2f}x |"
            )
        lines += [
            "",
            f"Compute-normalised ({d['profile']}: each run's host compute replaced by the device's "
            f"{d['device_ms']:.2f} ms token, its stall, blob decode and prediction scaled by 1 / k):",
            "",
            "| policy | compute-normalised decode tok/s | per round | simulated | sim error | oracle / this |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        norm_oracle = pols["oracle"]["normalised_tps"]
        for name, r in pols.items():
            rounds = " / ".join(f"{x:.0f}" for x in r["normalised_rounds"])
            lines.append(
                f"| {name} | {r['normalised_tps']:.0f} | {rounds} | {r['sim_tps']:.0f} "
                f"| {r['sim_tps'] / r['normalised_tps'] - 1:+.0%} "
                f"| {norm_oracle / r['normalised_tps']:.2f}x |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--devices", nargs="+", default=list(DEVICES))
    ap.add_argument("--budget", type=float, default=0.35)
    ap.add_argument(
        "--host-ms",
        type=float,
        default=None,
        help="this host's decode compute per token (pins k); default: measured at the start",
    )
    ap.add_argument(
        "--host-probes",
        type=int,
        default=3,
        help="without --host-ms: the planner probes whose median pins it (one drifts with the host)",
    )
    ap.add_argument("--trace", required=True, help="the sweep's (costs, trace) pickle: the simulator's input")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lod", action="store_true", help="also run load-on-demand bf16 and int4 (slow: every read)")
    ap.add_argument(
        "--resident-bits",
        type=int,
        choices=(8, 4),
        default=None,
        help="hold the resident linears at this precision in every run (and on the device's roofline)",
    )
    ap.add_argument("--sweep", default=None, help="the sweep's JSON: also run its best candidate per device")
    ap.add_argument("--out", default=None)
    add_results_arg(ap, "rewrite the table between the MARK markers of FILE (without FILE: docs/results/MARK.md)")
    ap.add_argument(
        "--mark", default=MARK, help=f"the table's markers (default {MARK}; the real-shape run: emulate-real)"
    )
    args = ap.parse_args(argv)
    if args.host_probes < 1:
        ap.error(f"--host-probes must be at least 1, not {args.host_probes}")
    torch.set_num_threads(1)
    store = ExpertStore(args.store)
    total = store.expert_bytes(4) * len(store.index["moe_layers"]) * store.index["num_experts"]
    budget = int(args.budget * total)
    ids = sample_token_ids(Tokenizer(args.store))[: args.prompt_tokens]
    costs, plan_trace = pickle.loads(Path(args.trace).read_bytes())
    plan_trace = first_tokens(plan_trace, args.decode_tokens)  # the simulator over the decode the engine runs
    with Engine(
        EngineConfig(args.store, 2 * total, "lru", resident_bits=args.resident_bits)
    ) as big:  # routing, for the oracle
        trace = big.record_trace(ids, GenerateConfig(max_tokens=args.decode_tokens + 1, ignore_eos=True))
    side = store_side(args.store, resident_bits=args.resident_bits)
    results = {}
    host_probes = []
    if args.host_ms is None:  # measured at the start, then the same k basis for every device and policy
        host_probes = [
            1e3 * host_token_seconds(args.store, ids, workers=1, resident_bits=side.resident_bits)[0]
            for _ in range(args.host_probes)
        ]  # one fetch worker, as the runs have
        args.host_ms = statistics.median(host_probes)
        print(
            f"host token: {' / '.join(f'{x:.1f}' for x in host_probes)} ms, pinned {args.host_ms:.1f}",
            file=sys.stderr,
            flush=True,
        )
    for device in args.devices:
        em = calibrate(device, args.store, ids, host_s_per_token=args.host_ms / 1e3, side=side)
        dev_costs = scale_costs(costs, 1 / em.k)
        dev_costs.layer_compute_s = em.device_s_per_token / len(store.index["moe_layers"])
        pols = {
            **policies(device, args.lod, args.store, args.resident_bits),
            **sweep_best(args.sweep, device, args.budget),
        }
        runs: dict[str, list[dict]] = {n: [] for n in pols}
        loads = []
        for _ in range(args.rounds):
            loads.append(open("/proc/loadavg").read().split()[0])
            for name, p in pols.items():
                runs[name].append(
                    run_once(
                        args.store,
                        budget,
                        p,
                        em,
                        ids,
                        args.decode_tokens,
                        trace if p.predictor == "oracle" else None,
                        args.resident_bits,
                    )
                )
                print(
                    f"  round {len(runs[name])} {name}: raw {runs[name][-1]['decode_tps']:.3g} tok/s decode "
                    f"(load {open('/proc/loadavg').read().split()[0]})",
                    file=sys.stderr,
                    flush=True,
                )
        out = {}
        for name, rs in runs.items():
            med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            med["decode_tps"] *= em.k  # device-equivalent
            med["prefill_tps"] *= em.k
            med["normalised_rounds"] = [r["normalised_tps"] for r in rs]
            med["sim_tps"] = sim(plan_trace, pols[name], budget, store, em.link, dev_costs).tokens_per_s
            out[name] = med
            shown = {k: v if isinstance(v, list) else round(v, 3) for k, v in med.items()}
            print(f"{device} {name}: {json.dumps(shown)}", flush=True)
        results[device] = {
            "profile": em.profile,
            "k": em.k,
            "host_ms": args.host_ms,
            "host_ms_probes": host_probes,
            "device_ms": em.device_s_per_token * 1e3,
            "rounds": args.rounds,
            "resident_bits": args.resident_bits,
            "load": "-".join(loads),
            "policies": out,
        }
    text = table(results)
    print(text)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    if args.results:
        replace_between_markers(results_file(args.mark) if args.results is True else args.results, args.mark, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
