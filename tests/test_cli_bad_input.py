"""Every subcommand, every option, a bad value: exit 2 and one ``fate-edge: error:`` line, never a traceback.

The options and their types are read from the real parsers (the dispatched commands' own, from their modules), so
an option added later without a type (or without an entry in FREE_TEXT) fails here. Values are rejected while
parsing, so nothing loads: main() runs in-process and the whole module takes seconds.
"""

import argparse

import pytest

from fate_edge.apps import cli_args, engine_args
from fate_edge.apps.cli import COMMANDS, build_parser, main, subcommand_parsers
from fate_edge.apps.command_line import model_path, model_path_as_path, model_ref, table_name
from fate_edge_lab.bench import scale_cli

# Options (and positionals) that take any text, so no value of them is bad input: output paths and free text.
FREE_TEXT = {
    "prompt",
    "out_dir",
    "out",
    "--system",
    "--api-key",
    "--model-alias",
    "--unix-socket",
    "--out-dir",
    "--json",
    "--markdown",
    "--plot",
    "--plots-dir",
    "--work-dir",
    "--out",
    "--predictors-dir",
}
FREE_TEXT_IN = {("bench-scale", "store"), ("bench-scale", "--gguf"), ("model-card", "--readme")}  # outputs there

NUMBERS = ["abc", "-1"]  # every numeric option's type rejects both (--seed aside: any integer is a seed)
BAD_BY_TYPE = {
    int: ["abc"],
    float: ["abc"],
    cli_args.positive_int: NUMBERS + ["0"],
    cli_args.non_negative_int: NUMBERS,
    cli_args.port_number: NUMBERS,
    cli_args.positive_float: NUMBERS + ["0"],
    cli_args.non_negative_float: NUMBERS,
    cli_args.fraction: NUMBERS,
    cli_args.below_one: NUMBERS + ["1"],
    cli_args.share: NUMBERS + ["1"],
    cli_args.byte_size: ["2XB", "-1", "0"],
    engine_args.prompt_cache_size: ["2XB", "-1", "none"],
    cli_args.existing_path: ["/nonexistent/model"],
    cli_args.existing_path_as_path: ["/nonexistent/corpus.txt"],
    # a model: neither a path nor a name in a local cache, nor a name that may be one (.. leaves the store)
    model_ref: ["/nonexistent/model", "nobody-here:notag", "../../etc:passwd"],
    model_path: ["/nonexistent/model", "nobody/nothing"],
    model_path_as_path: ["/nonexistent/model"],
    cli_args.tokens_or_context: ["abc", "0", "-1"],
    cli_args.thread_count: ["abc", "0", "-1"],
    cli_args.resident_width: ["abc", "2", "-1"],
    cli_args.device_name: ["tpu"],
    cli_args.link_name: ["nosuch-board"],
    cli_args.profile_name: ["nosuch-board"],
    cli_args.host_name: ["not a host!"],
    cli_args.non_empty: [""],
    table_name: ["", "../results", "a/b"],
    cli_args.octal_mode: ["rw-------", "999"],
    cli_args.host_list: ["localhost,not a host!"],
    cli_args.origin_list: ["localhost:3000", "http://bad host"],
    cli_args.emulated_device: ["nosuch-board", "host"],
    scale_cli.gb_list: ["abc", "0", "2,x"],
}
SIGNED = {"--seed"}  # int options where a negative number is valid
# What a command needs besides the bad value: (its positionals, its required options); MODEL: a model directory,
# OUT: a path to create.
REQUIRED = {
    "plan": ([], ["--memory-budget", "1MB"]),
    "convert": (["MODEL", "OUT"], []),
    "bench-scale": (["MODEL", "OUT"], []),
    "relayout": (["MODEL", "OUT"], []),
    "synth": (["OUT"], ["--like", "olmoe-1b-7b"]),
}


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    return subcommand_parsers()


def _cases():
    for cmd, parser in _subcommands().items():
        for action in parser._actions:
            if action.nargs == 0 or isinstance(action, argparse._HelpAction):
                continue  # flags take no value
            name = action.option_strings[-1] if action.option_strings else action.dest
            if name in FREE_TEXT or (cmd, name) in FREE_TEXT_IN:
                continue
            values = ["nosuch"] if action.choices is not None else []
            if action.type is not None or not values:
                assert action.type in BAD_BY_TYPE, f"{cmd} {name}: no type checks it; add one (cli_args)"
                values += BAD_BY_TYPE[action.type]
            if name in SIGNED:
                values = [v for v in values if v != "-1"]
            for value in values:
                yield pytest.param(cmd, parser, action, name, value, id=f"{cmd} {name} {value!r}")


def _argv(
    cmd: str, parser: argparse.ArgumentParser, action: argparse.Action, value: str, tmp_path, bundled_dir
) -> list[str]:
    positionals, options = REQUIRED.get(cmd, ([], []))
    positionals = [
        str(bundled_dir) if a == "MODEL" else str(tmp_path / "out") if a == "OUT" else a for a in positionals
    ]
    if action.option_strings:
        return [cmd, *positionals, *options, f"{action.option_strings[-1]}={value}"]
    at = [a for a in parser._actions if not a.option_strings].index(action)  # the bad value in its place
    return [cmd, *positionals[:at], value, *positionals[at + 1 :], *options]


@pytest.mark.parametrize("cmd,parser,action,name,value", list(_cases()))
def test_bad_value_is_one_error_line_and_exit_2(cmd, parser, action, name, value, tmp_path, bundled_dir, capsys):
    argv = _argv(cmd, parser, action, value, tmp_path, bundled_dir)
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, (argv, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fate-edge: error: "), (argv, err)
    assert "Traceback" not in err
    if action.option_strings:
        assert action.option_strings[-1] in lines[0]


def test_every_listed_subcommand_is_covered():
    assert {"run", "chat", "demo", "serve", "convert", "inspect", "calibrate", "plan", "probe", "bench"} <= set(
        _subcommands()
    )
    listed = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(COMMANDS) <= set(listed) and set(_subcommands()) == set(listed)
    covered = {case.values[0] for case in _cases()}
    assert covered == set(_subcommands()) - {"probe", "list"}  # probe and list take no options


@pytest.mark.parametrize(
    "argv,named",
    [
        (["run", "--memory-budget", "2XB", "hi"], "--memory-budget"),
        (["run", "--memory-budget", "-1", "hi"], "--memory-budget"),
        (["run", "--policy", "nosuch", "hi"], "fate-edge"),  # lists the valid presets
        (["serve", "--policy", "nosuch"], "auto"),
        (["demo", "--link", "nosuch"], "raspberry-pi-5-8gb"),
    ],
)
def test_the_reported_cases_name_the_option_or_the_valid_values(argv, named, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and named in err and len(err.strip().splitlines()) == 1
