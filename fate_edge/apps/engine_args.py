"""One way to open an :class:`Engine` from command-line arguments (run, chat, demo).

``add_engine_args`` declares the options (with the shared defaults of ``fate_edge.defaults``),
``EngineOptions.from_args`` reads them back, and ``open_engine`` builds the engine: store (converted once),
storage link, torch threads, and for ``--policy auto`` the planner, whose progress goes to ``log``.
Callers use the engine in a ``with`` block so it is closed on every path, errors included.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from fate_edge import defaults
from fate_edge.apps.cli_args import (
    add_policy_arg,
    byte_size,
    device_name,
    emulated_device,
    link_name,
    model_ref,
    positive_int,
    thread_count,
)

if TYPE_CHECKING:
    from fate_edge.devices.link import ThrottledLink
    from fate_edge.format.convert_progress import LoadStatus
    from fate_edge.runtime.auto_budget import BudgetChoice
    from fate_edge.runtime.engine import Engine
    from fate_edge.runtime.policy import PolicyConfig


@dataclass
class EngineOptions:
    model: str | None = None  # model directory or expert store; None: the bundled model
    memory_budget: int | str = defaults.MEMORY_BUDGET
    policy: str = defaults.POLICY
    device: str = defaults.DEVICE
    dtype: str = defaults.DTYPE
    link: str | None = None  # device profile whose storage link reads are throttled to
    threads: int | str | None = defaults.THREADS
    verify: str = defaults.VERIFY
    resident_bits: int | None = None  # quantize the resident weights (8 or 4); None keeps the model's dtype
    embedding_bits: int | None = None  # hold the embedding table in 8 or 4 bits; None keeps the model's dtype
    context_tokens: int = defaults.CONTEXT_TOKENS  # prompt + answer the memory account reserves room for
    device_profile: str | None = None  # the device this runs on (fate-edge takes its preset); None: detected
    # Sequences served together (runtime.batch); 0: the machine's default; None: the command's (serve batches at the
    # machine's default, run/chat/demo serve one request)
    max_batch: int | None = None
    prompt_cache: int | str = "auto"  # finished requests' KV kept for later prompts (runtime.prompt_cache); 0: off

    @classmethod
    def from_args(cls, args: argparse.Namespace, **override) -> EngineOptions:
        """The options ``args`` carries; those it lacks or leaves at None keep their defaults."""
        kw = {f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None}
        return cls(**(kw | override))


def add_engine_args(
    p: argparse.ArgumentParser,
    memory_budget: str | None = defaults.MEMORY_BUDGET,
    policy: str | None = defaults.POLICY,
    device: str = defaults.DEVICE,
    link: bool = True,
) -> None:
    """The options :class:`EngineOptions` reads. ``None`` defaults mean "not given" (``run`` then skips the engine)."""
    p.add_argument(
        "--model",
        default=None,
        type=model_ref,
        help="model directory, GGUF file or expert store, a Hugging Face id (org/name, org/name:Q4_K_M) or an "
        "Ollama name (name, name:tag) found in the local caches (default: the bundled tiny model)",
    )
    shown = memory_budget or defaults.MEMORY_BUDGET
    p.add_argument(
        "--memory-budget",
        default=memory_budget,
        type=byte_size,
        help=f"hard budget for expert memory, e.g. 64MB or 2GB, or auto: what this machine can give after the "
        f"resident weights, KV cache and a headroom, capped at every expert (default {shown})",
    )
    add_policy_arg(p, policy)
    p.add_argument("--device", default=device, type=device_name, help=f"auto, cpu or cuda (default {device})")
    p.add_argument(
        "--dtype",
        default=defaults.DTYPE,
        choices=["auto", "float32", "bfloat16"],
        help="compute dtype (default auto: bfloat16 on CUDA; on a CPU with AVX512-BF16 or AMX the faster of the two, "
        "measured once on this host; float32 elsewhere)",
    )
    p.add_argument(
        "--device-profile",
        default=None,
        type=emulated_device,
        help="the device this runs on (orin-nano, orin-nx, agx-orin, rpi5, rtx4060 or a profile): the "
        "fate-edge policy takes that device's preset (device_presets.py); default: the detected one",
    )
    if link:
        p.add_argument(
            "--link",
            default=None,
            type=link_name,
            help="throttle expert reads to a device profile's storage link (devices/profiles), or host",
        )
    p.add_argument(
        "--threads",
        type=thread_count,
        default=defaults.THREADS,
        help=f"torch CPU threads (default auto: {defaults.STREAMING_THREADS}, the cores this process may use less the "
        f"{defaults.FETCH_WORKERS} fetch worker(s), while experts stream; every core once a model the budget holds "
        "whole is loaded, where it is at least 1024 wide)",
    )
    p.add_argument(
        "--resident-bits",
        type=int,
        default=None,
        choices=[8, 4],
        help="quantize attention, dense MLPs, shared experts and lm_head to int8 (per channel) or int4 "
        "(default: keep --dtype)",
    )
    p.add_argument(
        "--embedding-bits",
        type=int,
        default=None,
        choices=[8, 4],
        help="hold the embedding table as int8 per row or int4 per group of 128/64/32, rows dequantized "
        "as gathered (default: keep --dtype)",
    )
    p.add_argument(
        "--context-tokens",
        type=positive_int,
        default=defaults.CONTEXT_TOKENS,
        help="prompt + answer tokens the memory account (printed at start, and checked against free "
        "memory before loading) reserves KV cache and activations for "
        f"(default {defaults.CONTEXT_TOKENS})",
    )
    p.add_argument(
        "--verify",
        default=defaults.VERIFY,
        choices=["once", "always"],
        help="expert store: check each blob's CRC32 on its first read (default) or on every read",
    )
    p.add_argument(
        "--prompt-cache",
        type=prompt_cache_size,
        default="auto",
        help="room for finished requests' KV cache, reused by later prompts that start the same (a chat's next "
        "turn prefills only its new message), part of the memory account: auto (one --context-tokens of KV), a "
        "size such as 256MB, or 0 (off)",
    )


def prompt_cache_size(value: str) -> str:
    """``--prompt-cache``: auto, a size, or 0."""
    return "0" if value.strip() == "0" else byte_size(value)


def make_link(name: str | None) -> ThrottledLink | None:
    """A throttled link for a device profile name (or 'host': this machine's probed profile); None for none."""
    if name in (None, "", "none"):
        return None
    from fate_edge.devices.link import ThrottledLink, storage_link

    if name == "host":
        from fate_edge.devices.probe import host_profile

        return ThrottledLink(storage_link(host_profile()))
    from fate_edge.devices.profile import load_profile

    return ThrottledLink(storage_link(load_profile(name)))


def resolve_store(
    model: str | Path | None,
    progress: bool = True,
    status: LoadStatus | None = None,
    resident_bits: int | None = None,
    embedding_bits: int | None = None,
) -> Path:
    """The expert store for ``model`` (a store, or a model converted once into the cache, its progress shown). A run
    asking for ``resident_bits``/``embedding_bits`` gets a store converted with them (none asked: the default's)."""
    from fate_edge.bundled import bundled_model_dir
    from fate_edge.format.convert import EMBEDDING_BITS, RESIDENT_BITS
    from fate_edge.format.converted_stores import ensure_store

    return ensure_store(
        model or bundled_model_dir(),
        progress=progress,
        status=status,
        resident_bits=resident_bits or RESIDENT_BITS,
        embedding_bits=embedding_bits or EMBEDDING_BITS,
    )


def policy_for_device(
    policy: str, device_profile: str | None = None, store: str | Path | None = None, resident_bits: int | None = None
) -> PolicyConfig:
    """The preset ``policy`` as it runs on ``device_profile``, or on the device this host is detected to be
    (devices/detect.py; none here: the host preset); with ``store``, the row that fits that model's read cost
    on the device (device_presets.for_device_and_store)."""
    from fate_edge.devices.detect import detect
    from fate_edge.planning.device_presets import for_device_and_store
    from fate_edge.runtime.policy import get_policy

    return for_device_and_store(get_policy(policy), device_profile or detect().profile, store, resident_bits)


def auto_budget(store: str | Path, opts: EngineOptions, device: str, bits: int = 4) -> BudgetChoice:
    """``--memory-budget auto``: the expert budget this machine can give beside the run's other parts."""
    from fate_edge.runtime.auto_budget import choose_budget, experts_cap, free_memory, memory_sources
    from fate_edge.runtime.memory_account import memory_account

    account = memory_account(
        store, 0, opts.dtype, opts.context_tokens, opts.resident_bits, None, opts.embedding_bits, opts.prompt_cache
    )
    return choose_budget(account, experts_cap(store, bits), free_memory(memory_sources(device)))


def print_account(store: str | Path, opts: EngineOptions, log: TextIO) -> None:
    """The run's predicted peak RSS by part (memory_account), printed before anything loads."""
    from fate_edge.runtime.budget import parse_bytes
    from fate_edge.runtime.memory_account import memory_account

    account = memory_account(
        store,
        parse_bytes(opts.memory_budget),
        opts.dtype,
        opts.context_tokens,
        opts.resident_bits,
        embedding_bits=opts.embedding_bits,
        prompt_cache=opts.prompt_cache,
    )
    print("[memory] predicted peak RSS by part:\n" + "\n".join(account.lines()), file=log, flush=True)


def open_engine(
    opts: EngineOptions,
    log: TextIO | None = None,
    progress: bool = True,
    account: TextIO | None = None,
    max_batch: int = 1,
    status: LoadStatus | None = None,
) -> Engine:
    """Build the engine ``opts`` describes. ``--policy auto`` runs the planner first and reports its probes,
    its pick and the decode speed it predicts on ``log`` (default stderr); ``account``: where to print the memory
    account before loading (``run`` and ``serve``: stderr); ``max_batch``: the command's default when ``opts``
    gives none; ``status``: the stage it is at (the daemon's /health)."""
    from fate_edge.format.checkpoint_layout import DTYPES
    from fate_edge.runtime.auto_budget import is_auto
    from fate_edge.runtime.auto_threads import set_load_threads, settle_threads
    from fate_edge.runtime.budget import parse_bytes
    from fate_edge.runtime.compute_dtype import resolve_dtype
    from fate_edge.runtime.engine import Engine
    from fate_edge.runtime.engine_config import EngineConfig, resolve_device
    from fate_edge.runtime.load_threads import in_own_thread
    from fate_edge.runtime.warm_up import warm_up

    log = log or sys.stderr
    # converting (once) and the planner's probes run torch on threads of their own: their OpenMP helper threads end
    # with them instead of slowing a batching engine's (runtime.load_threads)
    store = in_own_thread(lambda: resolve_store(opts.model, progress, status, opts.resident_bits, opts.embedding_bits))
    link = make_link(opts.link)
    set_load_threads(opts.threads)
    device = resolve_device(opts.device)
    opts = replace(opts, dtype=str(resolve_dtype(opts.dtype, device, store)))  # auto: the hardware's (compute_dtype)
    if is_auto(opts.memory_budget):  # the machine's room, said in one line (auto_budget)
        choice = auto_budget(store, opts, device)
        print(choice.line(), file=account or log, flush=True)
        opts = replace(opts, memory_budget=str(choice.budget))
    policy: str | PolicyConfig = opts.policy
    planned = None
    if policy == "auto":
        from fate_edge.devices.detect import detect
        from fate_edge.planning.planner import auto_plan

        def say(message: str) -> None:
            print(f"[planner] {message}", file=log, flush=True)

        say("choosing a policy for this host, budget and link (probes the engine; this takes a while)")
        if status is not None:
            status.set("planning")
        planned = in_own_thread(
            lambda: auto_plan(
                store,
                parse_bytes(opts.memory_budget),
                link.spec if link else None,
                dtype=DTYPES[opts.dtype],
                progress=say,
                device=opts.device_profile or detect().profile,
            )
        )
        p = planned.policy
        say(
            f"picked allocation={p.allocation} eviction={p.eviction} predictor={p.predictor} "
            f"lookahead={p.lookahead} width={p.prefetch_width}: predicts {planned.predicted_tokens_per_s:.1f} "
            f"decode tok/s, hit rate {100 * planned.predicted_hit_rate:.0f}%"
        )
        policy = p
    else:
        policy = policy_for_device(opts.policy, opts.device_profile, store, opts.resident_bits)
    if account is not None:
        print_account(store, opts, account)
    if status is not None:
        status.set("loading")
    engine = Engine(
        EngineConfig(
            store,
            opts.memory_budget,
            policy,
            dtype=opts.dtype,
            link=link,
            device=opts.device,
            verify=opts.verify,
            resident_bits=opts.resident_bits,
            embedding_bits=opts.embedding_bits,
            context_tokens=opts.context_tokens,
            max_batch=max_batch if opts.max_batch is None else opts.max_batch,
            prompt_cache=opts.prompt_cache,
        )
    )
    engine.planned = planned
    settle_threads(opts.threads, not engine.scheduler.all_at_hand, engine.model.config.hidden_size, engine.device)
    warm_up(engine.batcher, engine.scheduler, engine.model, engine._lock)  # with the requests' threads
    return engine
