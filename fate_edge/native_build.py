"""Building fate-edge's C kernels on first use with the system C compiler, cached by a hash of source and compiler.

The shared libraries live under ``$FATE_EDGE_CACHE`` (default ``~/.cache/fate-edge``)/native. No ``-march``: each
kernel picks its instruction set at run time, so one build serves any x86-64 host.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from fate_edge.app_dirs import cache_home


def compiler() -> str | None:
    """The C compiler to build with: ``$CC``, else cc, gcc or clang on PATH (None: none)."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


# How the kernels are compiled (beside -fPIC -shared): what a program built on a kernel's source uses too, so that
# it measures the kernel as the library runs it (a benchmark of a kernel's internals)
CFLAGS = ("-O3", "-fno-math-errno", "-fopenmp")


@functools.cache
def compiler_version(cc: str) -> str:
    """``cc --version``, asked once per process: each kernel's cache key holds it, and a process loads several."""
    return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def build_shared_library(src: bytes, name: str, cc: str, defines: tuple[str, ...] = ()) -> Path:
    """``src`` (C) compiled with ``cc`` (``defines``: macros it is compiled with, ``-D`` each) into
    ``<cache>/native/<name>-<hash>.so`` unless already there; older builds of ``name`` are removed. Raises
    RuntimeError with the compiler's message when the build fails."""
    version = compiler_version(cc)
    key = hashlib.sha256(src + version.encode() + " ".join(defines).encode()).hexdigest()[:16]
    lib = cache_home() / "native" / f"{name}-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        c_file, out = Path(tmp) / f"{name}.c", Path(tmp) / lib.name
        c_file.write_bytes(src)
        cmd = [cc, *CFLAGS, *(f"-D{d}" for d in defines), "-fPIC", "-shared", str(c_file), "-o", str(out), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()[-400:]}")
        os.replace(out, lib)  # atomic: a concurrent build of the same source writes the same bytes
    for old in lib.parent.glob(f"{name}-*.so"):  # builds of older sources: one per upgrade would pile up
        if old != lib:
            old.unlink(missing_ok=True)  # a process that loaded it keeps its mapping
    return lib


def load_kernel(
    package: str, source: str, name: str, what: str, defines: tuple[str, ...] = ()
) -> tuple[ctypes.CDLL | None, str]:
    """The library built from ``package``'s ``native/<source>`` (cached as ``name``; ``defines`` as
    :func:`build_shared_library` takes them), or None and why not: disabled by ``FATE_EDGE_NATIVE=0``, not an x86-64
    CPU, no C compiler, or the build failed (``what`` names the kernel in that message). The caller checks the
    instruction set its kernel needs."""
    if os.environ.get("FATE_EDGE_NATIVE", "1") == "0":
        return None, "disabled by FATE_EDGE_NATIVE=0"
    if os.uname().machine not in ("x86_64", "AMD64"):
        return None, f"no x86-64 CPU ({os.uname().machine})"
    cc = compiler()
    if cc is None:
        return None, "no C compiler (cc, gcc or clang) on PATH; install one, e.g. `apt install gcc`"
    try:
        src = resources.files(package).joinpath("native").joinpath(source).read_bytes()
        return ctypes.CDLL(str(build_shared_library(src, name, cc, defines))), "built"
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return None, f"building the native {what} failed: {e}"


class LazyKernel:
    """A kernel :func:`load_kernel` builds and loads on first use, once per process. ``setup`` checks the
    instruction set its kernel needs and declares its functions' argument types: it returns None, or why this CPU
    cannot run it."""

    def __init__(self, package: str, source: str, name: str, what: str, setup: Callable[[ctypes.CDLL], str | None]):
        self._args = (package, source, name, what)
        self._setup = setup
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._reason: str | None = None  # None: not loaded yet

    def available(self) -> tuple[bool, str]:
        """(usable here, why not)."""
        if self._reason is not None:  # loaded (or refused) once: every later call, without the lock
            return self._lib is not None, self._reason
        with self._lock:
            if self._reason is None:
                lib, reason = load_kernel(*self._args)
                why = self._setup(lib) if lib is not None else reason
                self._lib, self._reason = (lib, "built") if why is None else (None, why)
        return self._lib is not None, self._reason

    @property
    def lib(self) -> ctypes.CDLL:
        """The loaded library; RuntimeError naming why where it is not available."""
        if self._lib is not None:  # set once, before the reason (``available``)
            return self._lib
        ok, why = self.available()
        if not ok:
            raise RuntimeError(f"the native {self._args[3]} is not available: {why}")
        assert self._lib is not None
        return self._lib
