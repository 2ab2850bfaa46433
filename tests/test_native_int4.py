"""fate-edge's own int4 kernel (``quant.native``): agreement with dequantize-then-matmul within the bound its int8
activations allow, on both instruction-set paths; computing on stored bytes without a copy; fusing; falling back."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from fate_edge.quant import QuantSpec, dequantize, pack, quantize
from fate_edge.quant.linear import QuantizedLinear, default_kernel
from fate_edge.quant.native import NativeInt4, native_status, set_gemm_min_rows

from fate_edge.model.experts import QuantizedExpert


def _randn(shape, seed: int, std: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * std


def _bound(x: torch.Tensor, w_hat: torch.Tensor) -> torch.Tensor:
    """|x @ w.T - xq @ w.T| per output, for x quantized to int8 per 32 values (step max|x| / 127, error <= half
    a step): sum_k |w_k| * step_k / 2."""
    step = x.view(x.shape[0], -1, 32).abs().amax(-1, keepdim=True).expand(-1, -1, 32).reshape(x.shape) / 127
    return (step / 2) @ w_hat.abs().T


def test_native_kernel_builds_here():
    ok, why = native_status()
    assert ok, why  # CI and development hosts have a C compiler and AVX2 (torch.compile needs the compiler too)


@pytest.mark.parametrize("bits", [4, 3, 2])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
def test_native_agrees_with_dequant_within_the_activation_bound(bits, group, m):
    spec = QuantSpec(bits, group)
    w = _randn((48, 384), bits * 100 + group, 0.05)
    x = _randn((m, 384), m)
    q = quantize(w, spec)
    w_hat = dequantize(q, spec)
    lin = QuantizedLinear.from_quantized(q, spec, kernel="native-int4")
    assert lin.kernel == "native-int4"
    y = lin(x)
    assert y.shape == (m, 48) and y.dtype == torch.float32
    assert torch.all((y - x @ w_hat.T).abs() <= 1.01 * _bound(x, w_hat) + 1e-5)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("n", [40, 200])
def test_tiled_gemm_and_row_kernel_give_the_same_sums(group, n):
    """The prefill GEMM (16 weight rows per vector lane block) and the row kernel add the same integer dot products
    with the same scales: only the float order differs. Row counts past one 8-row tile and weight rows past the last
    full block of 16 (n = 40, 200) cover the tails; both are within the activation bound of dequantize-then-matmul."""
    spec = QuantSpec(4, group)
    q = quantize(_randn((n, 512), group + n, 0.05), spec)
    w_hat = dequantize(q, spec)
    lin = QuantizedLinear.from_quantized(q, spec, kernel="native-int4")
    for m in (3, 8, 17):
        x = _randn((m, 512), m)
        before = set_gemm_min_rows(1)
        try:
            tiled = lin(x)
            set_gemm_min_rows(10**9)
            rows = lin(x)
        finally:
            set_gemm_min_rows(before)
        torch.testing.assert_close(tiled, rows, rtol=1e-5, atol=1e-5)
        assert torch.all((tiled - x @ w_hat.T).abs() <= 1.01 * _bound(x, w_hat) + 1e-5)


@pytest.mark.parametrize("m", [1, 5, 12])
def test_bf16_activations_give_the_fp32_result_rounded(m):
    """bf16 x is widened and y rounded to bf16 inside the kernel (no tensor conversions around each call; the
    kernels write bf16 from their registers): the result is bit for bit the fp32 call on the widened x, rounded as
    torch rounds, on the row kernel (1 row) and the tiled GEMM (5 and 12 rows: one tile and a tile and a half); 76
    weight rows leave a partial block of 12 (masked stores); NaN stays NaN."""
    spec = QuantSpec(4, 64)
    lin = QuantizedLinear.from_quantized(quantize(_randn((76, 256), 3, 0.05), spec), spec, kernel="native-int4")
    x = _randn((m, 256), 4).to(torch.bfloat16)
    y = lin(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, lin(x.float()).to(torch.bfloat16))
    strided = _randn((256, m), 5).to(torch.bfloat16).T  # not contiguous: copied, still read as bf16
    assert torch.equal(lin(strided), lin(strided.float()).to(torch.bfloat16))
    assert torch.equal(lin(x.half()), lin(x.float()).half())  # other dtypes compute in fp32
    x[0, 0] = float("nan")
    assert torch.isnan(lin(x)[0]).all()


@pytest.mark.parametrize("m", [1, 5])
def test_bf16_output_ties_round_to_even(m):
    """Outputs exactly halfway between two bf16 values round to the even one, as torch rounds: x of integers with
    max |x| = 127 quantizes exactly, scale 1 and zero 0 make every y an exact integer sum, and each odd integer in
    [257, 407] lies halfway between bf16 neighbours 2 apart (the row kernel at 1 row, the tiled GEMM at 5)."""
    n, k = 76, 256
    codes = torch.zeros(n, k, dtype=torch.uint8)
    codes[:, 0] = 2  # 2 * 127
    for r in range(n):
        ones = 3 + 2 * r  # y = 254 + ones: 257, 259, ...
        codes[r, 1 : 1 + ones // 15] = 15
        codes[r, 1 + ones // 15] = ones % 15
    lin = NativeInt4(
        pack(codes, 4), torch.ones(n, k // 64, dtype=torch.float16), torch.zeros(n, k // 64, dtype=torch.float16), 64
    )
    x = torch.ones(m, k, dtype=torch.bfloat16)
    x[:, 0] = 127
    exact = torch.tensor([254.0 + 3 + 2 * r for r in range(n)]).expand(m, n)
    assert torch.equal(lin(x.float()), exact)
    assert torch.equal(lin(x), exact.to(torch.bfloat16))


def test_native_relative_error_on_an_expert_shape():
    """Qwen1.5-MoE's expert down projection, 8 tokens: the int8 activations add ~0.5% of the output's RMS."""
    spec = QuantSpec(4, 64)
    q = quantize(_randn((2048, 1408), 1, 0.02), spec)
    x = _randn((8, 1408), 2)
    ref = x @ dequantize(q, spec).T
    y = QuantizedLinear.from_quantized(q, spec, kernel="native-int4")(x)
    assert (y - ref).pow(2).mean().sqrt() < 0.01 * ref.pow(2).mean().sqrt()


def test_native_computes_on_the_stored_bytes():
    """A portable-layout blob's codes, scale and zero are used in place: decoding an expert copies nothing."""
    spec = QuantSpec(4, 64)
    q = quantize(_randn((64, 256), 3, 0.05), spec)
    codes = pack(q.codes, 4)
    lin = QuantizedLinear.from_packed(codes, q.scale, q.zero, spec, kernel="native-int4")
    assert lin.native.codes.data_ptr() == codes.data_ptr()
    assert lin.native.scale.data_ptr() == q.scale.data_ptr()
    x = _randn((2, 256), 4)
    assert torch.equal(lin(x), QuantizedLinear.from_quantized(q, spec, kernel="native-int4")(x))


def test_native_expert_fuses_gate_and_up():
    spec = QuantSpec(4, 64)
    gate, up, down = (
        QuantizedLinear.from_quantized(quantize(_randn(s, i, 0.05), spec), spec, kernel="native-int4")
        for i, s in enumerate([(128, 256), (128, 256), (256, 128)])
    )
    e = QuantizedExpert(gate, up, down)
    f = e.fused()
    assert f.gate_up is not None and f.gate_up.kernel == "native-int4" and f.nbytes == e.nbytes
    x = _randn((3, 256), 9)
    torch.testing.assert_close(f(x), e(x), rtol=0, atol=1e-6)


def _exact_x(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Integers whose every group of 32 reaches 127: the kernel's int8 step is then 1 and x quantizes exactly."""
    x = torch.randint(-127, 128, (m, k), generator=g).float()
    x[:, ::32] = 127
    return x


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 9])
def test_fp32_scales_and_zeros_are_read_as_they_are(group, m):
    """fp32 scale and zero parts (a GGUF's q4_K products, which fp16 would round) go into both kernels, row and
    tiled GEMM, as they are: on x that int8 quantizes exactly only fp32 accumulation separates the result from a
    float64 matmul with those weights, while an fp16 rounding of the scales is seen. 40 rows: partial blocks."""
    n, k = 40, 512
    g = torch.Generator().manual_seed(group + m)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=g) * 0.01 + 1e-3  # random fp32: almost never an fp16 number
    zero = -torch.rand(n, k // group, generator=g) * 0.1
    x = _exact_x(m, k, g)

    def w64(s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return (codes.double().view(n, -1, group) * s.double()[..., None] + z.double()[..., None]).view(n, k)

    want, size = x.double() @ w64(scale, zero).T, x.double().abs() @ w64(scale, zero).abs().T
    rounded = x.double() @ w64(scale.half(), zero.half()).T
    assert ((rounded - want).abs() > 2**-20 * size).any()  # the bound below tells an fp16 rounding apart
    lin = NativeInt4(pack(codes, 4), scale, zero, group)
    assert lin.scale.dtype == lin.zero.dtype == torch.float32
    for min_rows in (1000, 1):  # the row kernel, then the tiled GEMM
        before = set_gemm_min_rows(min_rows)
        try:
            y = lin(x)
        finally:
            set_gemm_min_rows(before)
        assert ((y.double() - want).abs() <= 2**-20 * size).all()


def test_mixed_scale_dtypes_widen_instead_of_rounding():
    g = torch.Generator().manual_seed(7)
    codes = pack(torch.randint(0, 16, (16, 128), generator=g, dtype=torch.uint8), 4)
    scale = torch.rand(16, 4, generator=g) + 0.5
    lin = NativeInt4(codes, scale, (-scale).half(), 32)
    assert lin.scale.dtype == lin.zero.dtype == torch.float32 and torch.equal(lin.scale, scale)
    lin = NativeInt4(codes, scale.bfloat16(), scale.bfloat16(), 32)
    assert lin.scale.dtype == torch.float16  # as before: the kernel's narrow dtype


def test_native_threads_give_the_same_result():
    spec = QuantSpec(4, 128)
    lin = QuantizedLinear.from_quantized(quantize(_randn((200, 512), 5, 0.05), spec), spec, kernel="native-int4")
    x = _randn((5, 512), 6)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lin(x)
        torch.set_num_threads(2)
        two = lin(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # rows are split between threads, never a sum


@pytest.mark.parametrize("rows", [1, 2])
def test_the_row_kernel_gives_the_same_bits_on_two_threads(rows):
    """Decode's 1-2 x rows take the row kernel, whose blocks of 16 weight rows the threads share out as they come
    (a late thread takes fewer): 33 blocks, the last one short, so the split differs from call to call."""
    spec = QuantSpec(4, 128)
    lin = QuantizedLinear.from_quantized(quantize(_randn((520, 512), 7, 0.05), spec), spec, kernel="native-int4")
    x = _randn((rows, 512), 8)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lin(x)
        torch.set_num_threads(2)
        twos = [lin(x) for _ in range(20)]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(one, two) for two in twos)


def _run(env: dict[str, str], code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.slow
def test_avx2_path_writes_bf16_as_torch_rounds():
    """The AVX2 path's bf16 output (its row kernel at 1 and 6 rows, its tiled GEMM at 12), 76 weight rows (a partial
    block of 4): bit for bit its fp32 result rounded by torch, NaN kept (rows from the sixth on hold one)."""
    code = """
import torch
from fate_edge.quant import QuantSpec, quantize
from fate_edge.quant.linear import QuantizedLinear
from fate_edge.quant.native import native_isa
spec = QuantSpec(4, 64)
g = torch.Generator().manual_seed(0)
w = quantize(torch.randn(76, 256, generator=g) * 0.05, spec)
lin = QuantizedLinear.from_quantized(w, spec, kernel="native-int4")
for m in (1, 6, 12):
    x = torch.randn(m, 256, generator=g).to(torch.bfloat16)
    x[5:, 3] = float("nan")  # rows from 5 on: NaN
    y = lin(x)
    same = torch.equal(y[:5], lin(x.float()).to(torch.bfloat16)[:5]) and bool(torch.isnan(y[5:]).all())
    print(native_isa(), m, y.dtype, same)
"""
    lines = [line.split() for line in _run({"FATE_EDGE_NATIVE": "avx2"}, code).splitlines()]
    assert [line[1:] for line in lines] == [[str(m), "torch.bfloat16", "True"] for m in (1, 6, 12)]
    assert all(line[0] == "avx2" for line in lines)


_ROW_ALONE = """
import torch
from fate_edge.quant import QuantSpec, quantize
from fate_edge.quant.linear import QuantizedLinear
from fate_edge.quant.native import native_isa, set_gemm_min_rows
set_gemm_min_rows(10**9)  # every row count on the row kernel
for group in (32, 64, 128):
    spec = QuantSpec(4, group)
    g = torch.Generator().manual_seed(group)
    lin = QuantizedLinear.from_quantized(quantize(torch.randn(37, 640, generator=g) * 0.05, spec), spec,
                                         kernel="native-int4")
    x = torch.randn(7, 640, generator=g)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(7)])
    print(native_isa(), group, all(torch.equal(lin(x[:m]), alone[:m]) for m in range(2, 8)))
"""


@pytest.mark.parametrize("env", [{}, {"FATE_EDGE_NATIVE": "avx2"}], ids=["best", "avx2"])
def test_a_row_gets_the_same_bits_alone_or_beside_others(env):
    """Decode's one row (its own pass over the weights) and the same row among 2-7 in one call (a batch's rows on the
    row kernel) add the same products in the same order, on this host's best path and on AVX2's: a request's
    tokens do not depend on what it is batched with. 37 weight rows: two blocks of 16 and a short one."""
    lines = [line.split() for line in _run(env, _ROW_ALONE).splitlines()]
    assert [line[1:] for line in lines] == [[str(group), "True"] for group in (32, 64, 128)]
    if env:
        assert all(line[0] == "avx2" for line in lines)


AGREE_ROWS = (6, 12)
_SUMS = """
import torch
from fate_edge.quant import QuantSpec, quantize
from fate_edge.quant.linear import QuantizedLinear
from fate_edge.quant.native import native_isa
for rows in ROWS:
    for group in (32, 64, 128):
        spec = QuantSpec(4, group)
        g = torch.Generator().manual_seed(group)
        q = quantize(torch.randn(100, 640, generator=g) * 0.05, spec)
        y = QuantizedLinear.from_quantized(q, spec, kernel="native-int4")(torch.randn(rows, 640, generator=g))
        print(rows, native_isa(), *[f"{v:.8e}" for v in y.flatten().tolist()])
""".replace("ROWS", repr(AGREE_ROWS))


@pytest.fixture(scope="module")
def avx2_and_best_sums() -> dict[int, tuple[list[list[str]], list[list[str]]]]:
    """Both row counts' sums from one child on the AVX2 path and one on this host's best: two interpreters (and
    kernel loads) rather than four → {rows: (avx2 lines, best lines)}, each line [isa, values...]."""
    avx2 = [line.split() for line in _run({"FATE_EDGE_NATIVE": "avx2"}, _SUMS).splitlines()]
    best = [line.split() for line in _run({}, _SUMS).splitlines()]
    return {
        rows: ([a[1:] for a in avx2 if a[0] == str(rows)], [b[1:] for b in best if b[0] == str(rows)])
        for rows in AGREE_ROWS
    }


@pytest.mark.parametrize("rows", AGREE_ROWS)
@pytest.mark.slow
def test_avx2_path_agrees_with_the_reference_and_with_avx512(rows, avx2_and_best_sums):
    """The AVX2 path (what AMD hosts without AVX-512 run) within the activation bound of dequantize-then-matmul,
    and equal to the AVX-512 path's sums where this host has both. 6 rows: AVX2's row kernel beside AVX-512's
    tiled GEMM; 12: both tiled GEMMs. 100 weight rows leave a partial block on both (8 and 16 rows a block)."""
    avx2, best = avx2_and_best_sums[rows]
    assert len(avx2) == len(best) == 3
    for group, a_line, b_line in zip((32, 64, 128), avx2, best):
        assert a_line[0] == "avx2"
        spec = QuantSpec(4, group)
        g = torch.Generator().manual_seed(group)
        q = quantize(torch.randn(100, 640, generator=g) * 0.05, spec)
        x = torch.randn(rows, 640, generator=g)
        w_hat = dequantize(q, spec)
        y2 = torch.tensor([float(v) for v in a_line[1:]]).view(rows, 100)
        assert torch.all((y2 - x @ w_hat.T).abs() <= 1.01 * _bound(x, w_hat) + 1e-5)
        if b_line[0] == "avx512-vnni":  # same integer sums; only the float order differs
            y5 = torch.tensor([float(v) for v in b_line[1:]]).view(rows, 100)
            torch.testing.assert_close(y2, y5, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_disabled_native_falls_back_with_a_reason():
    code = """
from fate_edge.quant import QuantSpec
from fate_edge.quant.linear import default_kernel
from fate_edge.quant.native import native_status
print(default_kernel((256, 2048), QuantSpec(4, 64), "cpu"), "|", native_status()[1])
"""
    kernel, reason = _run({"FATE_EDGE_NATIVE": "0"}, code).split(" | ")
    assert kernel == "torch-int4" and "FATE_EDGE_NATIVE=0" in reason


def test_default_kernel_for_stored_codes():
    """Where the native kernel runs (AVX512-VNNI or AVX2) stored int4 codes default to it, elsewhere to torch's."""
    from fate_edge.quant.native import native_is_default

    want = "native-int4" if native_is_default() else "torch-int4"
    assert default_kernel((2048, 1408), QuantSpec(4, 64), "cpu") == want
    assert default_kernel((2048, 1344), QuantSpec(4, 64), "cpu") != "native-int4"  # K not a multiple of 128
    assert default_kernel((2048, 1408), QuantSpec(8, 64), "cpu") != "native-int4"  # 8-bit codes: not 4-bit slots
    assert default_kernel((2048, 1408), QuantSpec(2, 64), "cpu") == want  # int2 codes fit the 4-bit slots


def test_onnxruntime_is_not_a_candidate_where_native_takes_the_shape():
    """ORT's sessions hold ~1.8x the int4 bytes (initializers and MLAS's prepacked copy): not worth it on a
    memory-bound device where the native kernel, at 1x, takes the shape."""
    from fate_edge.quant.linear import candidate_kernels

    cpu = torch.device("cpu")
    assert candidate_kernels((256, 1024), QuantSpec(4, 64), cpu) == ["torch-int4", "native-int4"]
    assert "ort-int4" in candidate_kernels((256, 192), QuantSpec(4, 64), cpu)  # K % 128: native does not apply


def _native_shaped_model(out):
    """A 2-layer Qwen2-MoE checkpoint whose expert matrices the native kernel takes (hidden and expert width 128)."""
    from _tiny_moe import build_wide_moe

    return build_wide_moe(out, 128, vocab=1024)


def test_streamed_experts_compute_on_the_native_kernel(tmp_path, monkeypatch):
    """convert's auto layout is portable where native is the default; the engine's streamed experts then run on
    it straight from their blobs, and the logits stay within int8-activation error of torch's kernel's."""
    from fate_edge.quant.native import native_is_default

    from fate_edge import Engine
    from fate_edge.format.converted_stores import ensure_store
    from fate_edge.format.store import ExpertStore
    from fate_edge.runtime.engine_config import EngineConfig

    model = _native_shaped_model(tmp_path / "m")
    monkeypatch.setenv("FATE_EDGE_CACHE", str(tmp_path / "cache"))
    native = ensure_store(model, cold_bits=None, progress=False)
    want = "portable" if native_is_default() else "cpu-int4"
    assert ExpertStore(native).precisions[4].layout == want
    ids = torch.tensor([[3, 17, 99, 5, 250, 8, 61, 7]])
    with Engine(EngineConfig(native, memory_budget="64MB", policy="lru")) as eng:
        expert = eng.model.experts.get(1, 2)
        assert expert.kernel == ("native-int4" if want == "portable" else "torch-int4")
        assert eng.scheduler.zero_copy  # decoded in its read buffer, which the cache keeps: no copy out
        logits = eng.model(ids, eng.model.new_cache())
    monkeypatch.setattr("fate_edge.format.converted_stores.native_is_default", lambda: False)
    monkeypatch.setattr("fate_edge.quant.linear.native_is_default", lambda: False)
    other = ensure_store(model, cold_bits=None, progress=False)
    assert ExpertStore(other).precisions[4].layout == "cpu-int4"
    assert (other != native) == (
        want == "portable"
    )  # without the native kernel torch's layout is the default: one store
    with Engine(EngineConfig(other, memory_budget="64MB", policy="lru")) as eng:
        assert eng.model.experts.get(1, 2).kernel == "torch-int4"
        ref = eng.model(ids, eng.model.new_cache())
    assert (logits - ref).pow(2).mean().sqrt() < 0.02 * ref.pow(2).mean().sqrt()


def test_decodes_to_views_per_layout_and_kernel(tmp_path, monkeypatch):
    """The scheduler computes in the read buffer (zero-copy) only where decoding copies nothing."""
    from fate_edge.format.convert import ConvertOptions, convert
    from fate_edge.format.store import ExpertStore, decodes_to_views

    model = _native_shaped_model(tmp_path / "m")
    store = ExpertStore(
        convert(model, tmp_path / "s", ConvertOptions.full(bits=4, cold_bits=2, layout="portable"), progress=False)
    )
    assert decodes_to_views(store.precisions[4]) == (
        default_kernel((128, 128), QuantSpec(4, 128), "cpu") == "native-int4"
    )
    assert not decodes_to_views(store.precisions[2])  # 2-bit codes are unpacked into 4-bit slots: a copy
    assert not decodes_to_views(store.precisions[16])
    monkeypatch.setattr("fate_edge.quant.linear.native_is_default", lambda: False)
    assert not decodes_to_views(store.precisions[4])  # torch's kernel repacks portable codes


def test_int8_linear_takes_widths_torchs_int8_kernel_crashes_on():
    """torch's CPU int8 kernel segfaults for K % 16 != 0 (a scaled DeepSeek's dense down_proj has K = 684): those
    dequantize instead, and agree with the kernel's answer where it runs."""
    from fate_edge.quant.int8 import Int8Linear, quantize_int8

    for k in (684, 688):
        codes, scale = quantize_int8(_randn((128, k), k, 0.05))
        x = _randn((16, k), 1)
        ref = x @ (codes.float() * scale.float()[:, None]).T
        torch.testing.assert_close(Int8Linear(codes, scale)(x), ref, rtol=0.02, atol=0.02)


@pytest.mark.slow
def test_a_new_build_removes_the_libraries_of_older_sources(tmp_path):
    """Each source version builds its own library (keyed by its hash); the older ones are removed, not piled up."""
    native_dir = tmp_path / "native"
    native_dir.mkdir()
    (native_dir / "int4_gemm-0123456789abcdef.so").write_bytes(b"an older build")
    out = _run(
        {"FATE_EDGE_CACHE": str(tmp_path)},
        "from fate_edge.quant.native import native_status; print(native_status()[0])",
    )
    assert out == "True"
    assert [p.name for p in native_dir.glob("*.so")] != ["int4_gemm-0123456789abcdef.so"]
    assert len(list(native_dir.glob("int4_gemm-*.so"))) == 1


def test_a_k_of_whole_groups_is_padded_to_the_kernels_128():
    """K = 1088 (17 groups of 64, like DeepSeek-V2-Lite's dense down_proj, K = 10944): zero columns up to 1152 let
    the native kernel take it, on both paths and in bf16, where torch's int4 kernel ran at a third of its speed."""
    spec = QuantSpec(4, 64)
    q = quantize(_randn((80, 1088), 11, 0.05), spec)
    w_hat = dequantize(q, spec)
    assert default_kernel((80, 1088), spec, "cpu", copies=True) == default_kernel((80, 1024), spec, "cpu")
    lin = QuantizedLinear.from_quantized(q, spec, kernel="native-int4")
    assert lin.shape == (80, 1088) and lin.native.codes.shape == (80, 1152 // 2)
    for m in (1, 6):
        x = _randn((m, 1088), m)
        y = lin(x)
        assert y.shape == (m, 80)
        assert torch.all((y - x @ w_hat.T).abs() <= 1.01 * _bound(x, w_hat) + 1e-5)
        assert torch.equal(lin(x.to(torch.bfloat16)), lin(x.to(torch.bfloat16).float()).to(torch.bfloat16))
    assert default_kernel((80, 1088), spec, "cpu") != "native-int4"  # stored codes: views, never a padded copy
    assert default_kernel((80, 192), spec, "cpu", copies=True) != "native-int4"  # a third more bytes: not worth it


def test_resident_int4_group_with_padded_k_counts_its_bytes_and_computes_the_same():
    from fate_edge.quant.native import native_is_default

    from fate_edge.model.layer import _quantized, quantize_group, quantized_group_bytes

    w = {"mlp.down_proj.weight": _randn((96, 1088), 12, 0.05)}
    ref = w["mlp.down_proj.weight"]
    quantize_group(w, ["mlp.down_proj"], 4)
    assert sum(t.numel() * t.element_size() for t in w.values()) == quantized_group_bytes((96, 1088), 1, 4)
    lin, sizes = _quantized(w, "mlp.down_proj")
    assert sizes == [96] and lin.shape == (96, 1088)
    assert lin.kernel == ("native-int4" if native_is_default() else "torch-int4")
    spec = QuantSpec(4, 64)
    w_hat = dequantize(quantize(ref, spec), spec)  # the zero columns leave the real columns' groups as they were
    x = _randn((5, 1088), 13)
    if lin.kernel == "native-int4":
        assert torch.all((lin(x) - x @ w_hat.T).abs() <= 1.01 * _bound(x, w_hat) + 1e-5)
    else:  # torch's kernel: bf16 activations
        want = x @ w_hat.T
        assert (lin(x) - want).pow(2).mean().sqrt() < 0.01 * want.pow(2).mean().sqrt()


@pytest.mark.slow
def test_a_matrix_built_directly_loads_the_kernel_first():
    """NativeInt4 built before anything asked for the kernel's status failed its first call with KeyError('lib')."""
    out = _run(
        {},
        """
import torch
from fate_edge.quant.native import NativeInt4
lin = NativeInt4(torch.zeros(32, 64, dtype=torch.uint8), torch.ones(32, 2).half(), torch.zeros(32, 2).half(), 64)
print(lin(torch.ones(1, 128)).abs().sum().item())
""",
    )
    assert out == "0.0"


def test_a_copied_or_pickled_matrix_computes_on_its_own_tensors():
    """A native matrix keeps its tensors' addresses for the kernel's arguments: a deep copy or a pickled copy
    holds new tensors and must hand the kernel those (the original freed, a stale address would read freed memory)."""
    import copy
    import pickle

    lin = QuantizedLinear.from_float(_randn((256, 256), 5), QuantSpec(4, 64), kernel="native-int4")
    x = _randn((3, 256), 6)
    want = lin(x)
    for c in (copy.deepcopy(lin), pickle.loads(pickle.dumps(lin))):
        assert c.native is not None and c.native.codes.data_ptr() != lin.native.codes.data_ptr()
        assert c.native.call_args(x, want)[:3] == [t.data_ptr() for t in c.native.parts]
        assert torch.equal(c(x), want)


_GUARDED = """
import ctypes, mmap, torch
from fate_edge.quant.native import NativeInt4
n, k, page = 256, 2048, mmap.PAGESIZE
nbytes = n * k // 2  # 256 KB: the row kernel's loads run 64 KB ahead of each pass of rows
region = mmap.mmap(-1, nbytes + page)
base = ctypes.addressof(ctypes.c_char.from_buffer(region))
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
assert libc.mprotect(base + nbytes, page, 0) == 0  # PROT_NONE: a read past the codes faults
g = torch.Generator().manual_seed(3)
codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
scale = (torch.rand(n, k // 64, generator=g) * 0.01).half()
zero = (torch.randn(n, k // 64, generator=g) * 0.01).half()
guarded = torch.frombuffer(region, dtype=torch.uint8, count=nbytes).view(n, k // 2)
guarded.copy_(codes)
x = torch.randn(1, k, generator=g).bfloat16()
torch.set_num_threads(1)
print(torch.equal(NativeInt4(guarded, scale, zero, 64)(x), NativeInt4(codes, scale, zero, 64)(x)))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mprotect guard page: Linux")
def test_the_row_kernels_loads_ahead_stay_inside_the_matrix():
    """At one x row the kernel loads a byte 64 KB ahead of each pass of rows (it fills the TLB on 4 KB pages): codes
    that end right before a page nothing may read give the same bits as the same codes elsewhere, and no fault."""
    assert _run({}, _GUARDED) == "True"
