"""Codes in rows of four (``quant.native.NativeInt4.interleave_rows``): the same matrix read from either layout gives
the same bits on every path of the kernel (one x row, a few, the tiled GEMM; AVX-512 and AVX2; one and two
threads; grouped and one-call experts), and the portable layout comes back unchanged."""

import copy
import pickle

import pytest
import torch
from fate_edge.quant import native
from fate_edge.quant.native import NativeInt4, gemm_grouped, native_status

pytestmark = pytest.mark.skipif(not native_status()[0], reason="needs the native int4 kernel (a C compiler, AVX2)")


def _matrix(n: int, k: int, g: int, f32: bool = False, seed: int = 0) -> NativeInt4:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    dtype = torch.float32 if f32 else torch.float16
    scale = (torch.rand(n, k // g, generator=gen) * 0.02 + 0.001).to(dtype)
    zero = (torch.rand(n, k // g, generator=gen) * -0.1).to(dtype)
    return NativeInt4(codes, scale, zero, g)


def _pair(n: int, k: int, g: int, f32: bool = False) -> tuple[NativeInt4, NativeInt4]:
    plain = _matrix(n, k, g, f32)
    four = _matrix(n, k, g, f32)
    four.interleave_rows()
    return plain, four


@pytest.fixture(params=[2, 1], ids=["avx512", "avx2"])
def isa(request):
    if request.param > native._lib().fe_int4_isa():
        pytest.skip("this CPU lacks AVX-512 VNNI")
    saved = native._state.isa
    native._state.isa = request.param
    yield request.param
    native._state.isa = saved


@pytest.mark.parametrize("n", [1, 3, 4, 7, 16, 61, 258])
@pytest.mark.parametrize("rows", [1, 2, 3, 9])
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_of_four_give_the_portable_layouts_bits(isa, n, rows, threads):
    plain, four = _pair(n, 384, 128)
    assert four.rows4 and not plain.rows4
    x = torch.randn(rows, 384, generator=torch.Generator().manual_seed(n)).bfloat16()
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert torch.equal(four(x), plain(x))
        assert torch.equal(four(x.float()), plain(x.float()))
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("f32", [False, True])
def test_every_group_size_and_scale_dtype(isa, g, f32):
    plain, four = _pair(37, 256, g, f32)
    for rows in (1, 2, 5):
        x = torch.randn(rows, 256)
        assert torch.equal(four(x), plain(x))


def test_a_padded_matrix_and_its_portable_parts_come_back():
    m = _matrix(10, 192, 64)  # K 192 padded to 256 with zero codes
    before = [t.clone() for t in m.parts]
    m.interleave_rows()
    assert m.rows4 and not torch.equal(m.codes, before[0])  # rewritten in place
    for a, b in zip(m.parts, before):
        assert torch.equal(a, b)
    x = torch.randn(3, 192)
    assert torch.equal(m(x), NativeInt4(*before, 64, in_features=192)(x))
    m.interleave_rows()  # a second call changes nothing
    assert torch.equal(m.parts[0], before[0])


def test_the_last_rows_past_a_whole_group_stay_where_they_were():
    m = _matrix(6, 256, 128)
    tail = m.codes[4:].clone()
    m.interleave_rows()
    assert torch.equal(m.codes[4:], tail)
    # the first four rows' chunks side by side: chunk 1 of row 2 is the group's sixth 64 bytes
    assert torch.equal(m.codes.view(-1)[6 * 64 : 7 * 64], m.parts[0][2, 64:128])


def test_grouped_calls_take_either_layout_side_by_side(isa):
    mats = [_pair(n, 256, 64) for n in (8, 13, 64)]
    xs = [torch.randn(r, 256).bfloat16() for r in (1, 2, 1)]
    want = [p(x) for (p, _), x in zip(mats, xs)]
    ys = [torch.empty_like(w) for w in want]
    gemm_grouped([(four if i != 1 else plain, x, y) for i, ((plain, four), x, y) in enumerate(zip(mats, xs, ys))])
    for y, w in zip(ys, want):
        assert torch.equal(y, w)


def test_a_copy_keeps_the_layout_it_holds():
    plain, four = _pair(12, 256, 128)
    copy = pickle.loads(pickle.dumps(four))
    assert copy.rows4
    x = torch.randn(1, 256)
    assert torch.equal(copy(x), plain(x))


def test_codes_already_in_rows_of_four_must_be_whole_chunks():
    with pytest.raises(ValueError, match="rows of four"):
        NativeInt4(
            torch.zeros(4, 100, dtype=torch.uint8), torch.ones(4, 5).half(), torch.zeros(4, 5).half(), 40, rows4=True
        )


def test_a_plan_rebuilt_reads_the_codes_it_rewrote_and_a_replaced_tensor_as_portable(monkeypatch):
    """Resident weights go into rows of four in place when a plan is built (``layer._quantized``); the plan is built
    again whenever the weights change, and must then read those codes as rows of four, but a tensor put in their
    place as the portable layout."""
    from fate_edge.model import layer
    from fate_edge.model.layer import Weights, _quantized, quantize_group

    monkeypatch.setattr(layer, "rows_of_four_pay", lambda: True)
    gen = torch.Generator().manual_seed(3)
    ref = torch.randn(12, 256, generator=gen)
    plain: dict = {"o.weight": ref.clone()}
    quantize_group(plain, ["o"], 4)
    w = Weights({k: v.clone() for k, v in plain.items()})
    x = torch.randn(2, 256, generator=gen)
    want = _quantized(plain, "o")[0](x)  # a plain dict: left as it is
    assert not _quantized(plain, "o")[0].native.rows4
    codes = w["o.nint4"]
    first = _quantized(w, "o")[0]
    assert first.native.rows4 and first.native.codes is codes and not torch.equal(codes, plain["o.nint4"])
    again = _quantized(w, "o")[0]  # rebuilt: the same tensor, already in rows of four
    assert again.native.rows4 and torch.equal(codes, first.native.codes)
    assert torch.equal(first(x), want) and torch.equal(again(x), want)
    twin = copy.deepcopy(w)  # its own codes, still in rows of four, and known to be
    assert twin.rows4 is not None and twin.rows4["o"]() is twin["o.nint4"] is not codes
    assert torch.equal(_quantized(twin, "o")[0](x), want)
    w["o.nint4"] = plain["o.nint4"].clone()  # a new tensor in the portable layout
    fresh = _quantized(w, "o")[0]
    assert torch.equal(fresh(x), want)


def test_the_engine_keeps_the_model_it_holds_in_rows_of_four_and_answers_with_the_same_logprobs(monkeypatch, tmp_path):
    """The default engine on a model wide enough for the native kernel (its cache holds every expert): on an AVX-512
    host its resident matrices and cached experts go into rows of four, and every token and logprob equals the
    portable layout's."""
    import gc

    from _tiny_moe import build_wide_moe

    from fate_edge.model import experts, layer
    from fate_edge.runtime.engine import Engine
    from fate_edge.runtime.generate import GenerateConfig

    model = build_wide_moe(tmp_path / "model", 256)
    cfg = GenerateConfig(max_tokens=10, ignore_eos=True, cache_prompt=False, logprobs=3)
    prompt = list(range(7, 31))

    def answer() -> tuple[list, int]:
        with Engine.load(model, threads=1) as eng:
            steps = [(s.token, s.logprob.logprob, list(s.logprob.top)) for s in eng.stream(prompt, cfg)]
            four = sum(o.rows4 for o in gc.get_objects() if isinstance(o, NativeInt4))
        return steps, four

    got, four = answer()
    for module in (experts, layer):
        monkeypatch.setattr(module, "rows_of_four_pay", lambda: False)
    want, none = answer()
    assert got == want and none == 0
    if native.rows_of_four_pay():  # the two layers' experts (4 each, gate, up, down) and resident matrices
        assert four >= 2 * 4 * 3
