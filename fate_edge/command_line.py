"""What every ``fate-edge`` command's parser shares: bad input is one ``fate-edge: error:`` line, and the plain
argument types (numbers, paths, device names).

Each type checks its value when the command line is parsed, before anything is loaded, and its message names
what is accepted; argparse prefixes the option's name. Types that read profiles or presets live with them
(``planning.device_costs``, ``apps.cli_args``).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

PROG = "fate-edge"


class CliParser(argparse.ArgumentParser):
    """argparse with errors on one line (``fate-edge: error: argument --x: ...``), exit status 2, no usage dump."""

    def error(self, message: str) -> NoReturn:
        print(f"{PROG}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def command_parser(command: str, description: str | None) -> CliParser:
    """The parser of ``fate-edge COMMAND``, its description (a module docstring) printed as written."""
    return CliParser(
        prog=f"{PROG} {command}", description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def _number(kind: type, ok: Callable[[float], bool], what: str) -> Callable[[str], float]:
    def parse(value: str):
        try:
            x = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not {what}") from None
        if not ok(x):
            raise argparse.ArgumentTypeError(f"{value!r} is not {what}")
        return x

    parse.__name__ = what  # argparse names the type in some messages
    return parse


positive_int = _number(int, lambda x: x > 0, "an integer >= 1")
non_negative_int = _number(int, lambda x: x >= 0, "an integer >= 0")
port_number = _number(int, lambda x: 0 <= x <= 65535, "a port number in 0..65535")
positive_float = _number(float, lambda x: x > 0 and x != float("inf"), "a number > 0")
non_negative_float = _number(float, lambda x: 0 <= x < float("inf"), "a number >= 0")
fraction = _number(float, lambda x: 0 < x <= 1, "a number in (0, 1]")
below_one = _number(float, lambda x: 0 <= x < 1, "a number in [0, 1)")
share = _number(float, lambda x: 0 < x < 1, "a number in (0, 1)")


def non_empty(value: str) -> str:
    if not value:
        raise argparse.ArgumentTypeError("must not be empty")
    return value


def table_name(value: str) -> str:
    """A results table's name: letters, digits, '.', '_' and '-' (it names a file in docs/results)."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", value):
        raise argparse.ArgumentTypeError(f"'{value}' is not a table name: use letters, digits, '.', '_' and '-'")
    return value


def existing_path(value: str) -> str:
    if not Path(value).exists():
        raise argparse.ArgumentTypeError(f"{value}: no such file or directory")
    return value


def _locate(value: str) -> Path:
    from fate_edge.errors import FateEdgeError
    from fate_edge.format.model_names import locate_model

    if not value:
        raise argparse.ArgumentTypeError("must not be empty: give a path, a Hugging Face id or an Ollama name")
    try:
        return locate_model(value)
    except FateEdgeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def model_ref(value: str) -> str:
    """A model: a path, a Hugging Face id (``org/name``, ``org/name:Q4_K_M``) or an Ollama name (``name:tag``) found
    in the local caches; checked now, kept as given (the engine resolves it, and names its store after it)."""
    _locate(value)
    return value


def model_path(value: str) -> str:
    """A model as :func:`model_ref` takes it, resolved to its path (for the commands that read files directly)."""
    return str(_locate(value))


def model_path_as_path(value: str) -> Path:
    """model_path, as a Path."""
    return _locate(value)


def existing_path_as_path(value: str) -> Path:
    """existing_path, as a Path."""
    return Path(existing_path(value))


def device_name(value: str) -> str:
    """auto, cpu, cuda or cuda:N (whether a GPU is there is checked when the engine opens)."""
    if value in ("auto", "cpu") or re.fullmatch(r"cuda(:\d+)?", value):
        return value
    raise argparse.ArgumentTypeError(f"unknown device {value!r}; use auto, cpu, cuda or cuda:N")
