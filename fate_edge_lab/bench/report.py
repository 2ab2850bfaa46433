"""The markdown report: a decode table per link, the headline table at the 35% budget with same-run ratios,
the planner's predictions against measurements, the peers, and what was skipped or failed."""

from __future__ import annotations

from fate_edge_lab.bench.config import ALL_PRESETS, LABELS, headline_budget
from fate_edge_lab.bench.results import find_result


def _fmt(v, spec=".2f", none="—"):
    return none if v is None else format(v, spec)


def _x(v):
    return "—" if v is None else f"{v:.2f}x"


def _budget_table(results: list[dict], link: str, presets: list[str], budgets: list[float], value) -> list[str]:
    """A policy x budget table of ``value(result)`` on ``link``, each with its ratio to load-on-demand (bf16)."""
    lines = ["| policy | " + " | ".join(f"{100 * b:.0f}%" for b in budgets) + " |", "|---|" + "---:|" * len(budgets)]
    for p in presets:
        cells = []
        for j, b in enumerate(budgets):
            r = find_result(results, link, p, b)
            if r is None:
                cells.append("—")
                continue
            if r["budget_fraction"] is None and j > 0:
                cells.append("〃")
                continue
            x = r.get("ratios", {}).get("load-on-demand", {}).get("decode")
            cells.append(f"{_fmt(value(r))} ({_x(x)})")
        lines.append(f"| {LABELS.get(p, p)} | " + " | ".join(cells) + " |")
    return lines


def describe_policy(q: dict) -> str:
    """A policy (PolicyConfig as a dict) in one line: name, allocation/eviction, predictor, lookahead and width."""
    width = f"mass {q.get('prefetch_mass')}" if q.get("prefetch_width") == "mass" else q.get("prefetch_width")
    return f"{q.get('name')}: {q.get('allocation')}/{q.get('eviction')}, " + (
        f"{q['predictor']} p={q.get('lookahead')} w={width}" if q.get("predictor") else "no prefetch"
    )


def emulation_note(em: dict) -> str:
    """One paragraph saying what a --emulate run assumed and measured."""
    roof = em["roofline"]
    return (
        f"Device-faithful emulation of {em['profile']}: one decode token reads {em['token_bytes'] / 1e6:.0f} MB "
        f"and does {em['token_flops'] / 1e9:.2f} GFLOP on the device ({em['token_work']}); its roofline "
        f"({roof['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, {roof['flops_per_s'] / 1e12:.2f} TFLOP/s "
        f"{roof['compute_unit']}, x{roof['efficiency']} efficiency) gives {em['device_s_per_token'] * 1e3:.2f} ms "
        f"per token; this host took {em['host_s_per_token'] * 1e3:.1f} ms ({em['host_probe']}), so k = "
        f"{em['dilation_k']:.3g}. The device's link ({em['device_link']['name']}, "
        f"{em['device_link']['bandwidth_bytes_per_s'] / 1e9:.3g} GB/s) runs at "
        f"{em['emulated_link']['bandwidth_bytes_per_s'] / 1e6:.4g} MB/s with "
        f"{em['emulated_link']['latency_s'] * 1e3:.3g} ms per request; {em['io']}. Raw figures are this host's; "
        "device-equivalent ones are raw x k"
    )


def markdown(result: dict) -> str:
    cfg, info, results = result["config"], result["model"], result["results"]
    budgets = sorted(cfg["budgets"])
    presets = [p for p in ALL_PRESETS if any(r["preset"] == p for r in results)] + sorted(
        {r["preset"] for r in results} - set(ALL_PRESETS)
    )
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
        f"every request on a cold engine after one warm-up request. {result['date']}, commit {result['commit']}"
        + (f", `{result['command']}`" if result.get("command") else "")
        + ".",
    ]
    if result.get("emulation"):
        lines += ["", emulation_note(result["emulation"]) + "."]
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
        spec_txt = (
            f"{chk.get('spec_gbps', 0):.3g} GB/s, {chk.get('spec_latency_us', 0):.0f} us/request"
            if chk.get("spec_gbps")
            else "unthrottled"
        )
        pc = [r["page_cache"] for r in results if r.get("link") == link and r.get("page_cache")]
        if pc:
            spec_txt += "; page cache " + (
                "dropped before every request" if all(x["dropped"] for x in pc) else f"NOT dropped ({pc[0]['note']})"
            )
        k = L.get("dilation")
        lines += [
            "",
            f"**{'Raw host decode' if k else 'Decode'} tokens/s, {L['title']}** ({spec_txt}; measured "
            f"through the fetch engine: {_fmt(chk.get('achieved_gbps'), '.3g')} GB/s, {chk.get('io', '?')}); in "
            "brackets: x load-on-demand (bf16) from the same run.",
            "",
        ]
        lines += _budget_table(results, link, presets, budgets, lambda r: r["median"]["decode_tps"])
        if k:
            lines += [
                "",
                f"**Device-equivalent decode tokens/s, {L['profile']}** (raw host tok/s above x k = "
                f"{k:.3g}: what the device would decode, by the emulation's roofline).",
                "",
            ]
            lines += _budget_table(
                results, link, presets, budgets, lambda r: r.get("device_equivalent", {}).get("decode_tps")
            )

    head_link = cfg["links"][0]
    hb = headline_budget(budgets)
    lens = [str(n) for n in result["prompts"]["lengths"]]
    planner = any("planner_predicted_decode_tps" in r for r in results)
    dil = result["links"][head_link].get("dilation")
    lines += [
        "",
        f"**At {100 * hb:.0f}% ({hb * info['int4_expert_bytes_total'] / 1e6:.0f} MB) on "
        f"{result['links'][head_link]['title']}**: ratios are this policy's decode "
        'tok/s over the reference\'s (same run, same link, same budget); "oracle/this" is how far the bound '
        "is ahead. Hit rate = expert uses served from the cache or a prefetch issued before the layer; "
        "exact = predicted top-k equal to the true top-k (decode).",
        "",
    ]
    hdr = (
        ["policy", "raw decode tok/s" if dil else "decode tok/s"]
        + [f"prefill {n} tok/s" for n in lens]
        + (["device-eq decode tok/s"] + [f"device-eq prefill {n} tok/s" for n in lens] if dil else [])
        + [
            "hit rate",
            "exact",
            "stall ms/tok",
            "MB read/tok",
            "peak RSS MiB",
            "x LOD bf16",
            "x LOD int4",
            "x fate",
            "oracle/this",
        ]
        + (["planner predicted"] if planner else [])
    )
    lines += ["| " + " | ".join(hdr) + " |", "|---|" + "---:|" * (len(hdr) - 1)]
    for p in presets:
        r = find_result(results, head_link, p, hb)
        if r is None:
            continue
        m, ra = r["median"], r.get("ratios", {})
        oracle = ra.get("oracle", {}).get("decode")
        dev = r.get("device_equivalent", {})
        row = (
            [LABELS.get(p, p), _fmt(m["decode_tps"])]
            + [_fmt(m["prefill_tps"].get(n), ".1f") for n in lens]
            + (
                [_fmt(dev.get("decode_tps")), *(_fmt(dev.get("prefill_tps", {}).get(n), ".1f") for n in lens)]
                if dil
                else []
            )
            + [
                _fmt(None if m["hit_rate"] is None else 100 * m["hit_rate"], ".0f") + "%",
                _fmt(None if m["exact_match"] is None else 100 * m["exact_match"], ".0f", "—")
                + ("%" if m["exact_match"] is not None else ""),
                _fmt(m["stall_ms_per_token"], ".1f"),
                _fmt(m["mb_read_per_token"], ".2f"),
                f"{r['peak_rss_bytes'] / 2**20:.0f}",
                _x(ra.get("load-on-demand", {}).get("decode")),
                _x(ra.get("load-on-demand-int4", {}).get("decode")),
                _x(ra.get("fate", {}).get("decode")),
                _x(1 / oracle if oracle else None),
            ]
        )
        if planner:
            row.append(_fmt(r.get("planner_predicted_decode_tps")))
        lines.append("| " + " | ".join(row) + " |")
    planned = [r for r in results if r["preset"] == "planned" and r.get("median")]
    if planned:
        lines += [
            "",
            "**Planner**: its predicted decode tok/s for the configuration it picked (simulated over its "
            "own probe's decode trace with the host costs it measured) against that configuration's "
            "measured decode tok/s in this run; then the same costs simulated over this run's prompt's own "
            "routing (the time model alone, apart from how well the probe's text stands for the prompt); "
            "then the same for the fate-edge preset beside its own row.",
            "",
            "| link | budget | picked | predicted (per round) | measured (per round) | error "
            "| predicted on this prompt's routing | error "
            "| fate-edge predicted | fate-edge measured | error | on this prompt's routing | error "
            "| auto / fate-edge | host costs (first round's probe) |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in sorted(planned, key=lambda r: (r["link"], r["budget_fraction"])):
            pick = describe_policy(r.get("policy", {}))
            perr, rerr = r.get("preset_prediction_error"), r.get("preset_prediction_error_on_run_routing")
            err_run = r.get("planner_error_on_run_routing")
            on_run = f"{_fmt(r.get('planner_predicted_on_run_routing'))} | " + (
                f"{100 * err_run:+.0f}%" if err_run is not None else "—"
            )
            beside = (
                f"{_fmt(r.get('preset_predicted_decode_tps'))} | {_fmt(r.get('preset_decode_tps'))} | "
                + (f"{100 * perr:+.0f}%" if perr is not None else "—")
                + f" | {_fmt(r.get('preset_predicted_on_run_routing'))} | "
                + (f"{100 * rerr:+.0f}%" if rerr is not None else "—")
                + f" | {_fmt(r.get('auto_over_preset'), '.2f')}"
            )
            err = r.get("planner_error")
            rounds = r.get("planner_predictions") or []
            measured = [q["requests"][str(min(result["prompts"]["lengths"]))].get("decode_tps") for q in r["runs"]]
            pred_s = _fmt(r.get("planner_predicted_decode_tps")) + (
                " (" + ", ".join(f"{v:.1f}" for v in rounds) + ")" if len(rounds) > 1 else ""
            )
            meas_s = _fmt(r["median"]["decode_tps"]) + (
                " (" + ", ".join(_fmt(v, ".1f") for v in measured) + ")" if len(measured) > 1 else ""
            )
            lines.append(
                f"| {result['links'][r['link']]['title']} | {100 * r['budget_fraction']:.0f}% | {pick} | "
                f"{pred_s} | {meas_s} | "
                + (f"{100 * err:+.0f}%" if err is not None else "—")
                + f" | {on_run} | {beside} | {r.get('planner_costs', '')} |"
            )
    mism = [
        f"{r['link']}/{r['preset']}/{r['budget_fraction']}"
        for r in results
        if r.get("tokens_match_int4_reference") is False and r["preset"] not in ("load-on-demand",)
    ]
    if result["int4_reference_tokens"] is not None:
        lines += [
            "",
            "Greedy tokens equal to the int4 reference in every int4 configuration"
            if not mism
            else "Greedy tokens differ from the int4 reference in: "
            + ", ".join(mism)
            + " (fate's int2 prefill tail changes the answer)" * any("/fate/" in s for s in mism),
        ]
    peers = [pr for pr in result["peers"] if "peer" in pr]
    if peers:
        lines += [
            "",
            "**Peers** (same checkpoint, same prompts and threads):",
            "",
            "| peer | mode | "
            + " | ".join(f"prefill {n} tok/s" for n in lens)
            + " | decode tok/s | peak RSS MiB | note |",
            "|---|---|" + "---:|" * (len(lens) + 2) + "---|",
        ]
        for pr in peers:
            if "skipped" in pr or "error" in pr:
                lines.append(
                    f"| {pr['peer']} | {pr.get('mode', '')} | "
                    + " | ".join("—" for _ in lens)
                    + f" | — | — | {pr.get('skipped') or pr.get('error')} |"
                )
                continue
            lines.append(
                f"| {pr['peer']} | {pr['mode']} | "
                + " | ".join(_fmt(pr["prefill_tps"].get(n), ".1f") for n in lens)
                + f" | {_fmt(pr.get('decode_tps'))} | {pr['peak_rss_bytes'] / 2**20:.0f} "
                f"| {pr.get('note', '')} |"
            )
    if result["skipped_presets"]:
        lines += ["", "Skipped presets: " + "; ".join(f"{k} ({v})" for k, v in result["skipped_presets"].items())]
    errors = [r for r in results if r.get("error")]
    if errors:
        lines += [
            "",
            "Failed configurations: "
            + "; ".join(f"{r['link']}/{r['preset']}/{r['budget_fraction']}: {r['error']}" for r in errors),
        ]
    lines += ["", "Links: " + "; ".join(f"{v['title']}: {v['source']}" for v in result["links"].values()) + "."]
    return "\n".join(lines)
