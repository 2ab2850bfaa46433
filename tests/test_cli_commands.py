"""The commands dispatched by name (fate_edge.apps.cli.COMMANDS, "module:function" as mlx-lm dispatches): each
one's --help through ``python -m fate_edge``, a bad argument as one error line with exit status 2, the rest of the
command line handed to the module's main, and ``fate-edge --help`` listing them without importing them."""

import json
import subprocess
import sys

import pytest

from fate_edge.apps import cli
from fate_edge.apps.cli import COMMANDS, main
from fate_edge.errors import FateEdgeError

NEW = ["bench-llamacpp", "bench-scale", "synth", "eval-quality", "model-card", "relayout"]


def test_the_promoted_scripts_are_commands():
    assert set(NEW) | {"bench"} == set(COMMANDS)


@pytest.mark.slow  # a child Python each
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_runs_through_python_m_fate_edge(command):
    proc = subprocess.run(
        [sys.executable, "-m", "fate_edge", command, "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: fate-edge {command} ") and "options:" in proc.stdout
    assert proc.stderr == ""


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_bad_argument_is_one_error_line_and_exit_2(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "--no-such-option"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    (line,) = err.splitlines()  # no usage dump, no traceback
    assert line.startswith("fate-edge: error: ") and line.endswith(f"(see fate-edge {command} --help)")
    assert "unrecognized arguments: --no-such-option" in line or "the following arguments are required" in line


def test_a_bad_value_names_the_option_and_what_it_takes(capsys):
    with pytest.raises(SystemExit) as info:
        main(["synth", "/tmp/x", "--like", "qwen1.5-moe-a2.7b", "--layers", "0"])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "fate-edge: error: argument --layers: '0' is not an integer >= 1 (see fate-edge synth --help)\n"
    )


_SEEN: list[list[str]] = []


def _fake_main(argv: list[str]) -> int:
    _SEEN.append(argv)
    if argv == ["--fail"]:
        raise FateEdgeError("the store is missing; convert it first")
    return 7


def test_main_hands_the_rest_of_the_line_to_the_commands_function(monkeypatch, capsys):
    monkeypatch.setitem(COMMANDS, "fake", (f"{__name__}:_fake_main", "a command for this test"))
    assert cli.resolve(COMMANDS["fake"][0]) is _fake_main
    assert main(["fake", "a", "--b", "-c"]) == 7 and _SEEN[-1] == ["a", "--b", "-c"]
    assert main(["fake", "--fail"]) == 2  # the library's errors read as every command's do
    assert capsys.readouterr().err == "fate-edge: error: the store is missing; convert it first\n"


@pytest.mark.slow  # a child Python
def test_top_level_help_lists_the_commands_without_importing_them():
    code = (
        "import json, sys\nfrom fate_edge.apps.cli import COMMANDS, main\ntry:\n    main(['--help'])\n"
        "except SystemExit:\n    pass\n"
        "print(json.dumps(sorted(m for m in sys.modules if m in {s.partition(':')[0] for s, _ in "
        "COMMANDS.values()})))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    *help_lines, imported = proc.stdout.strip().splitlines()
    assert json.loads(imported) == []
    listed = "\n".join(help_lines)
    for command, (_, summary) in COMMANDS.items():
        assert f"    {command} " in listed and " ".join(summary.split()[:3]) in listed, command
