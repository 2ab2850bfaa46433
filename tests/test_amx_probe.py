"""The AMX probe (research/amx_int4_tiles.c) builds against the int4 kernel it includes, and where this CPU
runs AMX its tile GEMM gives every output the kernel's bits (docs/batching.md quotes its timings on that claim)."""

from __future__ import annotations

import json
import subprocess

import pytest

from fate_edge.native_build import compiler
from tests._scripts import ROOT, load_script


@pytest.mark.parametrize("variant", ["one chunk at a time", "three phases"])
def test_amx_probe_matches_the_kernel_bit_for_bit(tmp_path, variant):
    cc = compiler()
    if cc is None:
        pytest.skip("no C compiler here (the probe, like the native kernel, is built with one)")
    probe = load_script("research/amx_int4_tiles.py")
    exe = probe.build(cc, probe.VARIANTS[variant], tmp_path / "probe")
    # 8 and 11 x rows (a second, partial pass of the tile's 8), groups of 64, N and K past one block and one chunk
    for rows in (8, 11):
        done = subprocess.run([str(exe), "48", "384", "64", str(rows), "1"], capture_output=True, text=True, cwd=ROOT)
        if done.returncode == probe.NO_AMX:
            assert "no AMX-INT8 here" in done.stdout
            return  # built and ran; this host cannot run the tiles
        assert done.returncode == 0, done.stderr
        r = json.loads(done.stdout)
        assert r["outputs"] == rows * 48
        assert r["differing"] == 0, f"{r['differing']} of {r['outputs']} outputs differ from the VNNI GEMM's bits"
