"""convert's hidden working directories: only those it made, for a process that is gone, are ever removed."""

import json
import os
import subprocess
import sys

import pytest

from fate_edge.apps.cli import main
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.format.store import is_store
from fate_edge.format.work_dirs import MARKER, MARKING, make_work_dir, remove_dead_work_dirs, replace_dir


def _dead_pid() -> int:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid is free
    return dead.pid


def _left_by_a_killed_convert(target) -> os.PathLike:
    """A working directory made by a process that then died without cleaning up (as kill -9 leaves it)."""
    script = (
        "import os, sys, pathlib\n"
        "from fate_edge.format.work_dirs import make_work_dir\n"
        f"d = make_work_dir(pathlib.Path({str(target)!r}))\n"
        "(d / 'resident.safetensors').write_bytes(b'x')\n"
        "print(d, flush=True)\n"
        "os._exit(0)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True).stdout
    return type(target)(out.strip())


def test_convert_keeps_every_folder_a_user_made_whatever_its_name(tmp_path, bundled_dir, capsys):
    dead = _dead_pid()
    user = {
        "named like an old store, dead pid": tmp_path / ".config.old-99999999",
        "named like a partial, dead pid": tmp_path / f".s.partial-{dead}",
        "pid past 2^31": tmp_path / f".s.partial-{2**40}",
        "the new pattern, but no marker": tmp_path / f".s.partial-{dead}-abcdef12",
    }
    for d in user.values():
        d.mkdir()
        (d / "precious.txt").write_text("keep me")
    renamed = _left_by_a_killed_convert(tmp_path / "s")
    elsewhere = renamed.rename(tmp_path / f".t.partial-{dead}-zzzzzz12")  # its marker names another folder
    user["a marked folder renamed since"] = elsewhere
    assert main(["convert", str(bundled_dir), str(tmp_path / "s"), "--quiet"]) == 0
    for why, d in user.items():
        assert d.is_dir(), why
        assert why == "a marked folder renamed since" or (d / "precious.txt").read_text() == "keep me", why
    assert is_store(tmp_path / "s")
    assert "removed" not in capsys.readouterr().err


def test_next_convert_removes_what_a_killed_convert_left_and_nothing_of_a_live_one(tmp_path, bundled_dir, capsys):
    stale = _left_by_a_killed_convert(tmp_path / "s")
    assert stale.is_dir() and (stale / MARKER).is_file()
    live = make_work_dir(tmp_path / "other")  # this process is alive
    convert(bundled_dir, tmp_path / "s", ConvertOptions.full(bits=4, keep_bf16=False), progress=False)
    assert not stale.exists() and live.is_dir()
    assert f"removed {stale}" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["s", live.name])
    assert not (tmp_path / "s" / MARKER).exists()  # the store itself carries no marker


def test_a_working_folder_killed_before_its_marker_was_in_place_is_removed(tmp_path, capsys):
    """A kill between making the folder and renaming its marker into place leaves it empty or holding only the
    marker being written (CI caught an empty marker left by a SIGKILL once, a folder then never removed)."""
    dead = _dead_pid()
    empty = tmp_path / f".s.partial-{dead}-abcdef12"
    half_marked = tmp_path / f".t.partial-{dead}-abcdef12"
    not_ours = tmp_path / f".u.partial-{dead}-abcdef12"
    for d in (empty, half_marked, not_ours):
        d.mkdir()
    (half_marked / MARKING).write_text('{"name": ')
    (not_ours / MARKING).write_text('{"name": ')
    (not_ours / "precious.txt").write_text("keep me")
    assert remove_dead_work_dirs(tmp_path) == [empty, half_marked]
    assert (not_ours / "precious.txt").read_text() == "keep me"
    assert f"removed {empty}" in capsys.readouterr().err


def test_a_marker_is_in_place_whole_with_nothing_else_beside_it(tmp_path):
    work = make_work_dir(tmp_path / "s")
    assert os.listdir(work) == [MARKER]
    assert json.loads((work / MARKER).read_text()) == {"name": work.name, "pid": os.getpid()}


def test_a_symlink_is_never_followed_nor_reported_removed(tmp_path, capsys):
    target = tmp_path / "victim"
    target.mkdir()
    (target / "precious.txt").write_text("keep me")
    real = _left_by_a_killed_convert(tmp_path / "s")
    (real / MARKER).rename(target / MARKER)  # a marker in the victim that names the link's name below
    link = tmp_path / real.name
    real.rename(tmp_path / "moved")
    link.symlink_to(target)
    assert remove_dead_work_dirs(tmp_path) == []
    assert (target / "precious.txt").exists() and link.is_symlink()
    assert "removed" not in capsys.readouterr().err


def test_a_planted_link_at_the_work_name_cannot_redirect_the_write(tmp_path, bundled_dir):
    """Names are new each time (mkdtemp): a symlink planted at a guessable name is neither reused nor followed."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / f".s.partial-{os.getpid()}").symlink_to(victim)
    convert(bundled_dir, tmp_path / "s", ConvertOptions.full(bits=4, keep_bf16=False), progress=False)
    assert is_store(tmp_path / "s") and list(victim.iterdir()) == []


def test_replacing_a_store_keeps_the_old_one_when_the_new_cannot_move_in(tmp_path, monkeypatch):
    target = tmp_path / "s"
    target.mkdir()
    (target / "store.json").write_text("{}")
    work = make_work_dir(target)
    (work / "store.json").write_text('{"new": 1}')
    real_rename = type(work).rename

    def failing(self, dst):
        if self == work:
            raise OSError("simulated")
        return real_rename(self, dst)

    monkeypatch.setattr(type(work), "rename", failing)
    with pytest.raises(OSError, match="simulated"):
        replace_dir(work, target)
    assert (target / "store.json").read_text() == "{}" and not (target / MARKER).exists()


def test_a_store_moved_aside_by_a_killed_convert_is_put_back(tmp_path):
    """The store being replaced is marked with the name it is about to take; killed between the two renames, the
    next convert puts it back and removes only the unfinished work."""
    target = tmp_path / "s"
    target.mkdir()
    (target / "store.json").write_text("{}")
    script = (
        "import os, pathlib, fate_edge.format.work_dirs as w\n"
        f"t = pathlib.Path({str(target)!r})\n"
        "work = w.make_work_dir(t)\n"
        "real = pathlib.Path.rename\n"
        "def die(self, dst):\n"
        "    if self == work:\n"
        "        os._exit(9)\n"
        "    return real(self, dst)\n"
        "pathlib.Path.rename = die\n"
        "w.replace_dir(work, t)\n"
    )
    assert subprocess.run([sys.executable, "-c", script]).returncode == 9
    assert not target.exists()
    removed = remove_dead_work_dirs(tmp_path)
    assert [p.name.split(".partial-")[0] for p in removed] == [".s"]  # the unfinished work only
    assert (target / "store.json").read_text() == "{}" and not (target / MARKER).exists()
    assert list(tmp_path.iterdir()) == [target]
