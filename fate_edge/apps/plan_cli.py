"""``fate-edge plan``: the planner's pick for a store, budget and device (the host, a device profile, or emulated
devices), printed with its prediction."""

from __future__ import annotations

import argparse
import sys

from fate_edge.sizes import format_bytes


def cmd_plan(args: argparse.Namespace) -> int:
    from fate_edge.apps.engine_args import resolve_store
    from fate_edge.format.store import ExpertStore
    from fate_edge.planning.host_costs import roofline_layer_time
    from fate_edge.planning.plan_presets import preset_candidates
    from fate_edge.planning.plan_trace import record_plan_trace, sample_token_ids
    from fate_edge.planning.planner import auto_plan, plan
    from fate_edge.runtime.budget import parse_bytes
    from fate_edge.tokenizer import Tokenizer

    store_dir = resolve_store(args.model)
    budget = parse_bytes(args.memory_budget)
    tok = Tokenizer(store_dir)
    ids = (
        tok.encode(open(args.corpus, encoding="utf-8").read())[: args.tokens]
        if args.corpus
        else sample_token_ids(tok, args.tokens)
    )
    if args.emulate:
        return _plan_emulated(store_dir, budget, args.emulate, ids)
    if args.device == "host":
        result = auto_plan(
            store_dir, budget, token_ids=ids, progress=lambda m: print(f"[planner] {m}", file=sys.stderr, flush=True)
        )
    else:
        from fate_edge.devices.link import storage_link
        from fate_edge.devices.profile import load_profile
        from fate_edge.fetch.store_provider import StoreExpertProvider
        from fate_edge.runtime.loader import load_model

        profile = load_profile(args.device)
        model = load_model(store_dir)
        experts = model.experts
        assert isinstance(experts, StoreExpertProvider)  # a store's experts stream through the fetch engine
        store = ExpertStore(store_dir)
        bits = experts.bits
        trace = record_plan_trace(model, ids, store_dir=store_dir)
        resident = sum(t.numel() * t.element_size() for t in model.w.values()) // model.config.num_hidden_layers
        layer_s = roofline_layer_time(model.config, profile, store.expert_bytes(bits), resident)
        presets = preset_candidates(args.device, store_dir)  # no probe on a profile: no measured error to add
        result = plan(
            trace,
            budget,
            store.expert_bytes(bits),
            store.precisions[bits].slot_bytes,
            storage_link(profile),
            layer_s,
            start=presets[0],
            presets=presets,
        )
        experts.close()
    print(f"model           {store_dir}")
    print(f"memory budget   {format_bytes(budget)} for experts, device {args.device}")
    print(result.describe())
    return 0


def _plan_emulated(store_dir, budget: int, devices: list[str], ids: list[int]) -> int:
    from fate_edge.planning.emulation import plan_emulated, resolve_device

    for d in devices:  # fail before the probes
        resolve_device(d)
    plans = plan_emulated(
        store_dir, budget, devices, ids[:64], progress=lambda m: print(f"[planner] {m}", file=sys.stderr, flush=True)
    )
    for device, (em, result) in plans.items():
        print(
            f"\n== {device} ({em.profile}): k = {em.k:.3g} (host {em.host_s_per_token * 1e3:.1f} ms / device "
            f"{em.device_s_per_token * 1e3:.3f} ms per token); the costs below are this host's x 1/k (the device's) "
            "and the tok/s device-equivalent"
        )
        print(result.describe())
    return 0
