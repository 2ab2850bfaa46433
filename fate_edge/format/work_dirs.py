"""Hidden working directories for atomic writes: a store (or any output folder) is written into a new hidden
sibling and renamed into place; a replaced one is moved aside first and removed last.

Only directories this module made are ever removed. Each carries a marker file that names the directory, so a
folder a user made with a similar name (``.config.old-99999999``), a symlink, another user's folder or a folder
renamed since is never touched, whatever its name says; one named as ours that holds nothing (killed before its
marker was in place) is removed too, which loses nothing. A directory is removed only once the process that made
it is gone (a convert killed before it could clean up).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import sys
import tempfile
from pathlib import Path

MARKER = ".fate-edge-work"
MARKING = MARKER + ".writing"  # the marker before it is renamed into place
PID_MAX = 1 << 22  # Linux's PID_MAX_LIMIT: a larger number in a name was not written by a process id
# .<target>.<kind>-<pid>-<token>: the token makes every name new, so nothing already there is reused or followed
_WORK_NAME = re.compile(r"^\.(.+)\.(partial|old)-(\d{1,7})-[A-Za-z0-9_]{6,16}$")


def make_work_dir(target: Path) -> Path:
    """A new, empty, marked hidden sibling of ``target`` to write it in (created here, never an existing path)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-{os.getpid()}-", dir=target.parent))
    _mark(path)
    return path


def replace_dir(work: Path, target: Path) -> None:
    """Move the finished ``work`` to ``target``; an existing ``target`` is moved aside (marked) and removed once
    ``work`` is in place, and put back if that rename fails."""
    mask = os.umask(0o022)
    os.umask(mask)
    work.chmod(0o777 & ~mask)  # mkdtemp made it 0700; the store gets the mode a plain mkdir would give
    if not target.exists():
        work.rename(target)
        (target / MARKER).unlink()  # after the rename: until then a crash leaves work removable
        return
    aside = target.parent / f".{target.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
    _mark(target, aside.name)  # names the folder it is about to become: a crash after the rename leaves it removable
    target.rename(aside)
    try:
        work.rename(target)
    except BaseException:
        aside.rename(target)
        (target / MARKER).unlink(missing_ok=True)
        raise
    (target / MARKER).unlink()
    shutil.rmtree(aside, ignore_errors=True)


def remove_dead_work_dirs(directory: Path) -> list[Path]:
    """Remove the working directories in ``directory`` that this module made for a process that is gone. A store
    moved aside whose replacement never moved in is put back instead."""
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    for path in sorted(directory.iterdir()):
        pid = _dead_owner(path)
        if pid is None:
            continue
        m = _WORK_NAME.match(path.name)
        target = directory / m.group(1) if m else path
        if m and m.group(2) == "old" and not target.exists() and not target.is_symlink():
            path.rename(target)
            (target / MARKER).unlink(missing_ok=True)
            print(f"restored {target}, moved aside by a convert that was interrupted", file=sys.stderr)
            continue
        shutil.rmtree(path, ignore_errors=True)
        if path.exists() or path.is_symlink():
            print(f"could not remove {path}, left by an interrupted convert; remove it by hand", file=sys.stderr)
            continue
        print(f"removed {path}, left by a convert that was interrupted (process {pid} is gone)", file=sys.stderr)
        removed.append(path)
    return removed


def _mark(path: Path, name: str | None = None) -> None:
    """Write the marker whole or not at all: a kill mid-write once left an empty marker, and a folder nobody could
    prove was ours (written in a temporary file renamed into place)."""
    unfinished = path / MARKING
    unfinished.write_text(json.dumps({"name": name or path.name, "pid": os.getpid()}))
    os.replace(unfinished, path / MARKER)


def _unfinished_work_dir(path: Path) -> bool:
    """A working folder killed before its marker was in place: it holds nothing, or only the marker being
    written. Removing it loses nothing, whoever made it."""
    try:
        return set(os.listdir(path)) <= {MARKING} and not (path / MARKING).is_symlink()
    except OSError:
        return False


def _dead_owner(path: Path) -> int | None:
    """The process id that made ``path`` when it is one of ours and that process is gone; else None."""
    m = _WORK_NAME.match(path.name)
    if not m or path.is_symlink() or not path.is_dir():
        return None
    pid = int(m.group(3))
    if pid == 0 or pid > PID_MAX or pid == os.getpid():
        return None
    marker = path / MARKER
    try:
        if path.stat().st_uid != os.getuid():
            return None
        if m.group(2) == "partial" and _unfinished_work_dir(path):
            return None if _alive(pid) else pid
        if marker.is_symlink() or not marker.is_file():
            return None
        if marker.stat().st_size > 4096 or json.loads(marker.read_text()) != {"name": path.name, "pid": pid}:
            return None
    except (OSError, ValueError):  # unreadable, or not our JSON
        return None
    return None if _alive(pid) else pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
