"""Argument types of the ``fate-edge`` CLI's own subcommands, and the types by option name that the parsers
written elsewhere (calibrate, serve) get: bad input is one ``fate-edge: error:`` line (command_line.CliParser).

The plain types (numbers, paths, device names) live in ``fate_edge.apps.command_line``, the device profile and
emulated device names in ``fate_edge.planning.device_costs``; they are imported here under their own names.
"""

from __future__ import annotations

import argparse
import ipaddress
import re
from collections.abc import Callable

from fate_edge.apps.command_line import (
    below_one,
    device_name,
    emulated_device,
    existing_path,
    existing_path_as_path,
    fraction,
    model_path,
    model_ref,
    non_empty,
    non_negative_float,
    non_negative_int,
    port_number,
    positive_float,
    positive_int,
    profile_name,
    share,
)
from fate_edge.errors import FateEdgeError


def byte_size(value: str) -> str:
    """A positive byte size such as 512MB, 2GB or 1.5GiB, or auto (kept as text: the engine reads it)."""
    from fate_edge.runtime.budget import parse_bytes

    if value.strip().lower() == "auto":
        return "auto"

    try:
        n = parse_bytes(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive size; write e.g. 512MB, 2GB or 1.5GiB")
    return value


def resident_width(value: str) -> int | None:
    """A resident precision convert writes: 8, 4, or none (the checkpoint's dtype)."""
    if value.lower() in ("none", "16", "bf16", "float"):
        return None
    if value in ("8", "4"):
        return int(value)
    raise argparse.ArgumentTypeError(f"{value!r}: use 8, 4 or none (keep the checkpoint's dtype)")


def tokens_or_context(value: str) -> int | None:
    """A token count >= 1, or 'context' (None): until end of text or the context is full."""
    if value.strip().lower() in ("context", "none"):
        return None
    return int(positive_int(value))


def thread_count(value: str) -> int | str:
    """A torch thread count >= 1, or auto (runtime.auto_threads)."""
    if value.strip().lower() == "auto":
        return "auto"
    return int(positive_int(value))


def link_name(value: str) -> str:
    """A device profile whose storage link reads are throttled to (see profile_name), or 'none'."""
    return value if value == "none" else profile_name(value)


def host_name(value: str) -> str:
    """An IP address or a syntactically valid host name (RFC 1123 labels)."""
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    label = r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"
    if len(value) <= 253 and re.fullmatch(rf"{label}(\.{label})*", value):
        return value
    raise argparse.ArgumentTypeError(
        f"{value!r} is neither an IP address nor a host name; e.g. 127.0.0.1, 0.0.0.0 or localhost"
    )


def policy_help(default: str | None = None) -> str:
    from fate_edge.runtime.policy import POLICY_CHOICES

    tail = f" (default {default})" if default else ""
    return f"policy preset, or auto (the planner picks for this host): {', '.join(POLICY_CHOICES)}{tail}"


def add_policy_arg(p: argparse.ArgumentParser, default: str | None) -> None:
    from fate_edge.runtime.policy import POLICY_CHOICES

    p.add_argument("--policy", default=default, choices=POLICY_CHOICES, metavar="POLICY", help=policy_help(default))


def octal_mode(value: str) -> str:
    """File permission bits in octal, like chmod (600, 0660); kept as text for the daemon's own parser."""
    from fate_edge.apps.server.unix_socket import parse_mode

    try:
        parse_mode(value)
    except FateEdgeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def comma_list(text: str) -> list[str]:
    """The non-empty, stripped items of a comma-separated option value."""
    return [item.strip() for item in text.split(",") if item.strip()]


def host_list(value: str) -> str:
    """Comma-separated host names or addresses, or '*' for any."""
    for name in comma_list(value):
        if name != "*":
            host_name(name.strip("[]"))
    return value


def origin_list(value: str) -> str:
    """Comma-separated browser origins (scheme://host[:port]), or '*' for any."""
    for origin in comma_list(value):
        m = re.fullmatch(r"(https?)://(\[[0-9A-Fa-f:.]+\]|[^/:\[\]]+)(:\d{1,5})?", origin)
        if origin != "*" and (m is None or (m.group(2)[0] != "[" and not _is_host(m.group(2)))):
            raise argparse.ArgumentTypeError(
                f"{origin!r} is not an origin; write scheme://host[:port], e.g. http://localhost:3000, or '*' for any"
            )
    return value


def _is_host(name: str) -> bool:
    try:
        host_name(name)
        return True
    except argparse.ArgumentTypeError:
        return False


# Types by option name, for the parsers written outside the CLI module (calibrate, bench, serve): the same
# option means the same thing in every subcommand. Output paths and free text (--host aside) take any string.
OPTION_TYPES: dict[str, Callable[[str], object]] = {
    "--model": model_ref,
    "--corpus": existing_path_as_path,
    "--gguf": existing_path,
    "--results": non_empty,
    "--memory-budget": byte_size,
    "--max-body-bytes": byte_size,
    "--device": device_name,
    "--host": host_name,
    "--port": port_number,
    "--threads": non_negative_int,
    "--fetch-workers": positive_int,
    "--max-queue": non_negative_int,
    "--max-tokens-default": tokens_or_context,
    "--shutdown-timeout": non_negative_float,
    "--tokens": positive_int,
    "--heldout-fraction": share,
    "--rank": positive_int,
    "--seq-len": positive_int,
    "--batch": positive_int,
    "--epochs": positive_int,
    "--lr": positive_float,
    "--expert-bytes": positive_int,
    "--int4-expert-mb": positive_float,
    "--budgets": fraction,
    "--prompt-tokens": positive_int,
    "--decode-tokens": positive_int,
    "--runs": positive_int,
    "--timeout": positive_float,
    "--time-limit": positive_float,
    "--socket-mode": octal_mode,
    "--allowed-hosts": host_list,
    "--cors-origins": origin_list,
    "--emulate": emulated_device,
    "--emulate-host-ms": positive_float,
}


def use_option_types(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Give ``parser``'s options their types from OPTION_TYPES where they declared a plain class or none, and
    --policy / --presets the policy names."""
    from fate_edge.runtime.policy import POLICY_CHOICES, PRESETS

    for action in parser._actions:  # argparse has no public API to revisit declared options
        if not action.option_strings and action.dest == "model":  # a positional model directory, read as files
            action.type = model_path
        for opt in action.option_strings:
            # a class (int, Path) or none is replaced; a checking function of ours stays (engine_args' --threads)
            if opt in OPTION_TYPES and (action.type is None or isinstance(action.type, type)):
                action.type = OPTION_TYPES[opt]
            elif opt == "--policy" and action.choices is None:
                action.choices, action.metavar = POLICY_CHOICES, "POLICY"
            elif opt == "--presets" and action.choices is None:
                action.choices = list(PRESETS)
    return parser


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """``run`` and ``chat``'s sampling options."""
    p.add_argument(
        "--max-tokens",
        type=non_negative_int,
        default=None,
        help="most tokens to generate (default: until end of text or the context, --context-tokens)",
    )
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=non_negative_int, default=0, help="0 disables it")
    p.add_argument("--top-p", type=fraction, default=1.0, help="nucleus sampling share, in (0, 1]")
    p.add_argument("--min-p", type=below_one, default=0.0, help="in [0, 1); 0 disables it")
    p.add_argument("--repetition-penalty", type=positive_float, default=1.0, help="1 disables it")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], type=non_empty, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
