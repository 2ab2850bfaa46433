"""``fate-edge chat``: an interactive, streaming chat with a live status line.

On a terminal the last row shows tokens/s, the expert hit rate and memory while the answer streams
(the text scrolls above it). With stdin or stdout not a terminal it reads one message per line and
prints the status after each answer on stderr, so it can be scripted: ``printf 'hi\\n/stats\\n' | fate-edge chat``.

Commands: ``/reset`` (forget the conversation), ``/stats`` (engine statistics), ``/exit`` (or ``/quit``, EOF).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from typing import Any, TextIO

from fate_edge.sizes import format_bytes

HELP = "commands: /reset forget the conversation · /stats engine statistics · /exit quit (also Ctrl-D)"


def add_chat_parser(sub) -> argparse.ArgumentParser:
    from fate_edge.apps.cli_args import add_sampling_args
    from fate_edge.apps.engine_args import add_engine_args

    p = sub.add_parser("chat", help="interactive streaming chat with a live status line (/reset, /stats, /exit)")
    add_engine_args(p)
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--no-status", action="store_true", help="no status line")
    add_sampling_args(p)
    p.set_defaults(func=cmd_chat)
    return p


def _rss() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except Exception:  # pragma: no cover
        from fate_edge.process_memory import peak_rss_bytes

        return peak_rss_bytes()


def status_line(engine: Any, step: Any, stats: Any) -> str:
    """One line: speed, this answer's expert hit rate, and memory (process RSS, expert memory vs budget)."""
    experts = (engine.cache.used_bytes if engine.cache is not None else 0) + engine.plan.pool_bytes
    speed = f"{step.generation_tps:.1f} tok/s" if step.generation_tokens >= 2 else "- tok/s"  # one token: no rate
    parts = [f"{step.generation_tokens} tok", speed]
    if stats is not None and stats.uses:
        parts.append(f"hit rate {100 * stats.hit_rate:.0f}%")
        parts.append(f"stall {1e3 * stats.stall_s:.0f} ms")
    parts.append(f"experts {format_bytes(experts)}/{format_bytes(engine.budget)}")
    parts.append(f"RSS {format_bytes(_rss())}")
    return " · ".join(parts)


def stats_report(engine: Any, turns: int, context_tokens: int) -> str:
    s = engine.stats
    read = s.demand_bytes + s.prefetch_bytes + s.wasted_bytes
    cache = engine.cache
    lines = [
        f"policy {engine.policy.name} on {engine.device}; expert budget {format_bytes(engine.budget)} "
        f"(cache {format_bytes(engine.plan.cache_bytes)}, read buffers {format_bytes(engine.plan.pool_bytes)})",
        f"expert uses {s.uses}: {s.hits} cached, {s.prefetch_hits} prefetched, {s.misses} demand reads "
        f"(hit rate {100 * s.hit_rate:.1f}%)",
        f"read {format_bytes(read)} ({format_bytes(s.demand_bytes)} on the critical path, "
        f"{format_bytes(s.wasted_bytes)} prefetched unused); "
        f"stall {1e3 * s.stall_s:.0f} ms; {s.prediction_summary}",
        f"expert cache {format_bytes(cache.used_bytes if cache is not None else 0)} used; process RSS "
        f"{format_bytes(_rss())}",
        f"conversation: {turns} turns, {context_tokens} of {engine.model.config.max_position_embeddings} "
        "context tokens",
    ]
    return "\n".join(lines)


class _StatusBar:
    """The terminal's last row as a status line; the text scrolls in the rows above (ANSI scroll region)."""

    def __init__(self, out: TextIO, enabled: bool):
        self.out = out
        self.enabled = enabled
        self.rows = 0
        if enabled:
            self.rows = shutil.get_terminal_size((80, 24)).lines
            if self.rows < 3:
                self.enabled = False
            else:
                # Make room, then confine scrolling to rows 1..rows-1.
                out.write("\n\x1b[1A\x1b7" + f"\x1b[1;{self.rows - 1}r" + "\x1b8")
                out.flush()

    def show(self, text: str) -> None:
        if not self.enabled:
            return
        width = shutil.get_terminal_size((80, 24)).columns
        self.out.write(f"\x1b7\x1b[{self.rows};1H\x1b[2K\x1b[7m{text[: width - 1]}\x1b[0m\x1b8")
        self.out.flush()

    def close(self) -> None:
        if self.enabled:
            self.out.write(f"\x1b7\x1b[{self.rows};1H\x1b[2K\x1b[r\x1b8")
            self.out.flush()
            self.enabled = False


def _fit(engine: Any, history: list[dict[str, str]], reserve: int) -> tuple[list[int], int]:
    """Token ids of the conversation; drops the oldest turns (never the system prompt) until it fits."""
    context = engine.model.config.max_position_embeddings
    dropped = 0
    while True:
        ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(history))
        if len(ids) + reserve < context or len(history) <= 1:
            return ids, dropped
        first = 1 if history[0]["role"] == "system" else 0
        if len(history) - first <= 1:
            return ids, dropped
        del history[first]
        dropped += 1


def cmd_chat(args: argparse.Namespace) -> int:
    from fate_edge.apps.engine_args import EngineOptions, open_engine
    from fate_edge.sdk import generate_config

    out, err = sys.stdout, sys.stderr
    interactive = sys.stdin.isatty() and out.isatty()
    t0 = time.perf_counter()
    config_kw = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    config = generate_config(**config_kw)  # checked before the model loads
    with open_engine(EngineOptions.from_args(args), progress=False) as engine:
        return _chat(engine, args, config, time.perf_counter() - t0, out, err, interactive)


def _chat(
    engine: Any, args: argparse.Namespace, config: Any, load_s: float, out: TextIO, err: TextIO, interactive: bool
) -> int:
    from fate_edge.sdk import stream

    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, str]] = list(system)
    context_tokens = 0
    print(
        f"fate-edge chat · policy {engine.policy.name} · expert budget {format_bytes(engine.budget)} · loaded in "
        f"{load_s:.1f} s\n{HELP}",
        file=err,
        flush=True,
    )
    bar = _StatusBar(out, interactive and not args.no_status)
    try:
        while True:
            try:
                if interactive:
                    line = input("\n> ")
                else:
                    line = sys.stdin.readline()
                    if not line:
                        break
            except EOFError:
                break
            line = line.strip()
            if not line:
                continue
            if line.startswith("/"):
                cmd = line.split()[0].lower()
                if cmd in ("/exit", "/quit", "/bye"):
                    break
                if cmd == "/reset":
                    history = list(system)
                    context_tokens = 0
                    print("(conversation cleared)", file=err, flush=True)
                elif cmd == "/stats":
                    print(
                        stats_report(engine, sum(m["role"] == "user" for m in history), context_tokens),
                        file=err,
                        flush=True,
                    )
                else:
                    print(HELP, file=err, flush=True)
                continue
            history.append({"role": "user", "content": line})
            ids, dropped = _fit(engine, history, reserve=min(args.max_tokens or 64, 64))
            if dropped:
                print(f"(dropped the {dropped} oldest messages to fit the context)", file=err, flush=True)
            context_tokens = len(ids)
            parts: list[str] = []
            last, shown = None, 0.0
            steps = stream(engine, ids, config)
            try:
                for last in steps:
                    parts.append(last.text)
                    out.write(last.text)
                    out.flush()
                    now = time.perf_counter()
                    if now - shown > 0.1 or last.finish_reason:
                        bar.show(status_line(engine, last, engine.request_stats))
                        shown = now
            except KeyboardInterrupt:
                print("\n(interrupted)", file=err, flush=True)
            finally:
                steps.close()
            out.write("\n")
            out.flush()
            history.append({"role": "assistant", "content": "".join(parts)})
            if last is not None:
                context_tokens += last.generation_tokens
                line = status_line(engine, last, engine.request_stats)
                if bar.enabled:
                    bar.show(line)
                elif not args.no_status:
                    print(f"[{line}]", file=err, flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        bar.close()
    return 0
