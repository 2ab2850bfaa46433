"""The int4 kernel's AVX-VNNI build (``FE_AVX_VNNI`` in quant/native/int4_gemm.c): VPDPBUSD where the AVX2 path adds
VPMADDUBSW's int16 pairs and widens them, the same integers, so every output keeps the plain AVX2 build's bits (the
row kernel at one to seven x rows, the tiled GEMM, rows of four, fp16 and fp32 scales, bf16 output, the grouped
call); and which build a host loads."""

import os
import subprocess
import sys

import pytest
from fate_edge.quant.native import native_status, takes_avx_vnni

from fate_edge.native_build import cpu_flags

_NO_VNNI = "avx_vnni" not in cpu_flags()

_OUTPUTS = """
import hashlib
import torch
from fate_edge.quant.native import NativeInt4, gemm_grouped, native_isa

def matrix(n, k, g, f32, seed, four):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    dtype = torch.float32 if f32 else torch.float16
    scale = (torch.rand(n, k // g, generator=gen) * 0.02 + 0.001).to(dtype)
    zero = (torch.rand(n, k // g, generator=gen) * -0.1).to(dtype)
    m = NativeInt4(codes, scale, zero, g)
    if four:
        m.interleave_rows()
    return m

print("isa", native_isa())
for threads in (1, 2):
    torch.set_num_threads(threads)
    for g in (32, 64, 128):
        for f32 in (False, True):
            for four in (False, True):
                m = matrix(100, 640, g, f32, g + threads, four)
                for rows in (1, 2, 3, 6, 9, 12, 40):
                    x = torch.randn(rows, 640, generator=torch.Generator().manual_seed(rows))
                    for y in (m(x), m(x.bfloat16())):
                        digest = hashlib.sha256(y.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
                        print(threads, g, f32, four, rows, y.dtype, digest)
    ms = [matrix(64, 256, 64, False, s, False) for s in range(3)]
    xs = [torch.randn(r, 256, generator=torch.Generator().manual_seed(r)).bfloat16() for r in (1, 5, 16)]
    ys = [torch.empty(x.shape[0], 64, dtype=torch.bfloat16) for x in xs]
    gemm_grouped(list(zip(ms, xs, ys)))
    print(threads, "grouped", *[hashlib.sha256(y.view(torch.uint8).numpy().tobytes()).hexdigest()[:16] for y in ys])
"""


def _outputs(choice: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", _OUTPUTS],
        env={**os.environ, "FATE_EDGE_NATIVE": choice},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.mark.skipif(not native_status()[0], reason="needs the native int4 kernel (a C compiler, AVX2)")
@pytest.mark.skipif(_NO_VNNI, reason="this CPU lacks AVX-VNNI")
def test_the_avx_vnni_build_gives_the_plain_avx2_builds_bits():
    plain, vnni = _outputs("avx2"), _outputs("avxvnni")
    assert plain[0] == "isa avx2" and vnni[0] == "isa avx2+avx-vnni"
    assert len(plain) == len(vnni) == 1 + 2 * (3 * 2 * 2 * 7 * 2 + 1)
    assert plain[1:] == vnni[1:]
    assert len(set(plain[1:])) == len(plain) - 1  # every case its own output: the digests cover the values


def test_which_build_a_host_loads():
    avx2, vnni = {"avx2", "fma"}, {"avx2", "fma", "avx_vnni"}
    avx512 = vnni | {"avx512f", "avx512bw", "avx512_vnni"}
    assert not takes_avx_vnni(None, avx2)  # a Zen 3 or an older Intel: the build every host takes
    assert takes_avx_vnni(None, vnni)  # an Intel client core since Alder Lake, or Sierra Forest
    assert not takes_avx_vnni(None, avx512)  # the AVX-512 path runs: its own VNNI
    assert takes_avx_vnni("avxvnni", avx512)  # the AVX2 path with AVX-VNNI on an AVX-512 host (comparisons)
    assert not takes_avx_vnni("avx2", vnni)  # the plain AVX2 path, asked for
    assert not takes_avx_vnni("avxvnni", avx2)  # asked for where the CPU cannot run it: the plain build
