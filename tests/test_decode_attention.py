"""fate-edge's CPU decode attention (model/decode_attention.py): as accurate as torch's against float64, on caches read
in place (strided views, ranges of a batch's slab, sliding windows), and taken by every bf16 decode path."""

import pytest
import torch
import torch.nn.functional as F

from fate_edge import Engine, GenerateConfig
from fate_edge.model import decode_attention, sdpa
from fate_edge.model.batch_step import Segment, forward_segments
from fate_edge.model.kv_slab import KVSlab
from fate_edge.runtime.loader import load_model

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not decode_attention.available()[0], reason=f"kernel: {decode_attention.available()[1]}"),
]


def _reference(q, k, v, scale):
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=scale, enable_gqa=gqa)


def _err(a, b) -> float:
    return (a.double() - b).abs().max().item()


@pytest.fixture(params=[1, 2], ids=["avx2", "avx512"])
def isa(request):
    """Each instruction-set path of the kernel: 8 floats a vector, and 16 where the CPU has AVX-512."""
    used = decode_attention.use_isa(request.param)
    if used != request.param:
        decode_attention.use_isa(2)
        pytest.skip("this CPU lacks AVX-512 (F, BW): only the AVX2 path runs here")
    yield used
    decode_attention.use_isa(2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "hq, hkv, dk, dv, length",
    [
        (16, 16, 128, 128, 85),
        (4, 2, 32, 32, 37),
        (32, 8, 128, 128, 700),
        (8, 1, 64, 64, 1),
        (16, 16, 192, 128, 50),
        (4, 2, 48, 48, 70),
        (4, 4, 40, 24, 16),
    ],
    # head sizes: multiples of 32 (bf16 rows widened split on both paths), 48 (split on AVX2 only), 40 and 24
    # (neither: a vector of 8 at a time, the AVX-512 path falling back to AVX2)
    ids=["mha", "bundled-gqa", "gqa-long", "mqa-one-key", "mla-dk-not-dv", "bundled-48", "head-40-24"],
)
def test_as_accurate_as_torch_on_a_strided_cache(isa, dtype, hq, hkv, dk, dv, length):
    g = torch.Generator().manual_seed(length)
    q = torch.randn(2, hq, 1, dk, generator=g).to(dtype)
    # views of caches with room to spare, as a KV cache hands them out
    kc = torch.randn(2, hkv, length + 20, dk, generator=g).to(dtype)
    vc = torch.randn(2, hkv, length + 20, dv, generator=g).to(dtype)
    k, v = kc.narrow(2, 0, length), vc.narrow(2, 0, length)
    assert not k.is_contiguous()
    assert decode_attention.takes(q, k, v, (dtype,))
    scale = dk**-0.5
    exact = _reference(q, k, v, scale)
    ours = decode_attention.attend(q, k, v, scale)
    assert ours.dtype == dtype and ours.shape == (2, hq, 1, dv)
    theirs = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=scale, enable_gqa=hq != hkv)
    # torch's fp32 result rounded once to the dtype: the best a kernel returning that dtype can do, and no better
    rounding = _err(theirs.to(dtype), exact)
    assert _err(ours, exact) <= 1.25 * rounding + 1e-6


def test_the_avx2_and_avx512_paths_agree(isa):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 16, 1, 128, generator=g).bfloat16()
    k, v = torch.randn(1, 16, 300, 128, generator=g).bfloat16(), torch.randn(1, 16, 300, 128, generator=g).bfloat16()
    ours = decode_attention.attend(q, k, v, 0.1)
    decode_attention.use_isa(1)
    narrow = decode_attention.attend(q, k, v, 0.1)
    assert (ours.float() - narrow.float()).abs().max() <= 2**-7  # one bf16 rounding apart at most
    exact = _reference(q, k, v, 0.1)
    assert _err(ours, exact) < 1e-2 and _err(narrow, exact) < 1e-2


def test_ranges_of_one_slab_match_each_sequence_alone():
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, cap = 8, 2, 64, 300
    k = torch.randn(hkv, cap, d, generator=g).bfloat16()
    v = torch.randn(hkv, cap, d, generator=g).bfloat16()
    q = torch.randn(3, hq, d, generator=g).bfloat16()
    starts = torch.tensor([0, 100, 257], dtype=torch.int64)
    lengths = torch.tensor([90, 1, 43], dtype=torch.int64)
    out = decode_attention.attend_ranges(q, k, v, starts, lengths, 0.125)
    for r in range(3):
        a, n = int(starts[r]), int(lengths[r])
        kr, vr = k[None, :, a : a + n], v[None, :, a : a + n]
        alone = decode_attention.attend(q[r][None, :, None], kr, vr, 0.125)[0, :, 0]
        assert torch.equal(out[r], alone)  # a row's arithmetic does not depend on the other rows
        assert _err(out[r], _reference(q[r][None, :, None], kr, vr, 0.125)[0, :, 0]) < 2e-2


def test_a_nan_in_one_sequence_stays_in_that_sequence():
    q = torch.randn(2, 4, 1, 32).bfloat16()
    k, v = torch.randn(2, 2, 10, 32).bfloat16(), torch.randn(2, 2, 10, 32).bfloat16()
    k[1, 0, 3, 5] = float("nan")
    out = decode_attention.attend(q, k, v, 0.2)
    assert out[1, :2].isnan().all() and not out[1, 2:].isnan().any()  # kv head 0 serves query heads 0 and 1
    assert not out[0].isnan().any()


def test_sdpa_sends_only_unmasked_bf16_and_fp16_decode_queries_to_the_kernel(monkeypatch):
    calls = []
    real = decode_attention.attend
    monkeypatch.setattr(decode_attention, "attend", lambda *a: calls.append(a[0].dtype) or real(*a))
    q, k = torch.randn(1, 4, 1, 32), torch.randn(1, 2, 9, 32)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        sdpa.attention(q.to(dtype), k.to(dtype), k.to(dtype), scale=0.3, enable_gqa=True)
    assert calls == [torch.bfloat16, torch.float16]  # fp32 keeps torch's bits (fp32 parity, alone = batched)
    qb, kb = q.bfloat16(), k.bfloat16()
    sdpa.attention(qb, kb, kb, attn_mask=torch.ones(1, 9, dtype=torch.bool), enable_gqa=True)
    sdpa.attention(qb, kb[:, :, :1], kb[:, :, :1], is_causal=True, enable_gqa=True)
    sdpa.attention(torch.randn(1, 4, 3, 32).bfloat16(), kb, kb, enable_gqa=True)  # a prompt: three queries
    assert len(calls) == 2


def test_the_batched_step_attends_from_the_slab_as_torch_does(bundled_dir, bundled_tokenizer, monkeypatch):
    model = load_model(bundled_dir, torch.bfloat16)
    prompts = ["def main():", "import os\n", "class Point:", "x = "]
    ids = [bundled_tokenizer.encode(p) for p in prompts]

    def decode_two_steps() -> torch.Tensor:
        slab = KVSlab(model, 256)
        segs = [Segment(i, slab.allocate(64)) for i in ids]
        forward_segments(model, segs)  # the prompts
        for s in segs:
            s.ids = [7]
        forward_segments(model, segs)
        for s in segs:
            s.ids = [11]
        return forward_segments(model, segs)  # decode rows only: every row's attention over its slab range

    taken = []
    real = decode_attention.attend_ranges
    monkeypatch.setattr(decode_attention, "attend_ranges", lambda *a: taken.append(1) or real(*a))
    native = decode_two_steps()
    assert len(taken) == 2 * model.config.num_hidden_layers
    monkeypatch.setattr(decode_attention, "takes_ranges", lambda *a: False)  # torch's gathered, masked attention
    torch_side = decode_two_steps()
    assert len(taken) == 2 * model.config.num_hidden_layers
    assert (native.float() - torch_side.float()).abs().max().item() <= 0.125  # bf16 logits near 8 step by 0.03
    assert (native.argmax(-1) == torch_side.argmax(-1)).float().mean().item() >= 0.75


def test_a_bf16_engine_decodes_with_the_kernel_alone_and_batched(monkeypatch):
    calls = {"alone": 0, "batched": 0}
    real_attend, real_ranges = decode_attention.attend, decode_attention.attend_ranges

    def count(name, real):
        def spy(*a):
            calls[name] += 1
            return real(*a)

        return spy

    monkeypatch.setattr(decode_attention, "attend", count("alone", real_attend))
    monkeypatch.setattr(decode_attention, "attend_ranges", count("batched", real_ranges))
    cfg = GenerateConfig(max_tokens=6, ignore_eos=True)
    with Engine.load(memory_budget="2MB", device="cpu", dtype="bfloat16", max_batch=1) as alone:
        text = alone.generate_text("def main():", cfg)[0]
    assert text and calls["alone"] >= 5 * 8  # every decode token, every layer
    with Engine.load(memory_budget="2MB", device="cpu", dtype="bfloat16", max_batch=4) as batched:
        streams = [batched.stream(p, cfg) for p in ("def main():", "import os\n", "x = ")]
        texts = ["".join(s.text for s in stream) for stream in streams]
    assert all(texts) and calls["batched"] > 0


@pytest.mark.parametrize("window", [None, 1, 3, 50])
def test_slab_ranges_see_the_positions_the_mask_lets_through(window):
    # the batched step's native path reads ranges where the torch path masks a gathered block: the same keys
    from fate_edge.model.kv_slab import SlabRows

    lengths = [5, 1, 12, 7]
    first = torch.tensor([0, 40, 80, 200])
    d = SlabRows([], torch.arange(4), first + torch.tensor(lengths) - 1, first, lengths, every_row=True)
    with torch.device("meta"):  # made on the host whatever the default device (the kernel reads their memory)
        starts, counts = d.ranges(window)
    assert starts.device.type == counts.device.type == "cpu"
    mask = d.mask(window)[:, 0, 0]  # [S, longest]: positions first[j] + i
    for j in range(4):
        seen = (first[j] + mask[j].nonzero().flatten()).tolist()
        assert seen == list(range(int(starts[j]), int(starts[j] + counts[j])))


def _reference_sinks(q, k, v, scale, sinks):
    """gpt-oss's attention in float64: each head's sink one more logit in the softmax, weighing no value."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = q.double() @ k.transpose(-1, -2) * scale
    logits = torch.cat([scores, sinks.double().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], -1)
    return logits.softmax(-1)[..., :-1] @ v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hq, hkv, d, length", [(8, 2, 64, 130), (4, 4, 48, 9), (8, 1, 64, 1)])
def test_attention_sinks_are_as_accurate_as_torch(isa, dtype, hq, hkv, d, length):
    """gpt-oss's sinks in the kernel's softmax (a sink can outweigh every key: the largest logit then): as near the
    float64 result as that result rounded once to the dtype, on both instruction-set paths."""
    g = torch.Generator().manual_seed(length)
    q = torch.randn(2, hq, 1, d, generator=g).to(dtype)
    k, v = torch.randn(2, hkv, length, d, generator=g).to(dtype), torch.randn(2, hkv, length, d, generator=g).to(dtype)
    sinks = torch.randn(hq, generator=g) * 3
    sinks[0] = 20.0  # above every score: the softmax's maximum is the sink's
    exact = _reference_sinks(q, k, v, d**-0.5, sinks)
    ours = decode_attention.attend(q, k, v, d**-0.5, sinks)
    assert _err(ours, exact) <= 1.25 * _err(exact.to(dtype), exact) + 1e-6
    assert _err(decode_attention.attend(q, k, v, d**-0.5), exact) > 1e-2  # the sinks moved it


def test_ranges_with_sinks_match_each_sequence_alone():
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(2, 200, 64, generator=g).bfloat16(), torch.randn(2, 200, 64, generator=g).bfloat16()
    q, sinks = torch.randn(2, 8, 64, generator=g).bfloat16(), torch.randn(8, generator=g)
    starts, lengths = torch.tensor([0, 150], dtype=torch.int64), torch.tensor([120, 7], dtype=torch.int64)
    out = decode_attention.attend_ranges(q, k, v, starts, lengths, 0.125, sinks)
    for r in range(2):
        a, n = int(starts[r]), int(lengths[r])
        alone = decode_attention.attend(q[r][None, :, None], k[None, :, a : a + n], v[None, :, a : a + n], 0.125, sinks)
        assert torch.equal(out[r], alone[0, :, 0])


def test_two_threads_give_the_bits_of_one():
    """The threads share out (sequence, kv head) tasks as they come; each task is one thread's arithmetic."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 16, 1, 128, generator=g).bfloat16()
    k, v = torch.randn(1, 16, 90, 128, generator=g).bfloat16(), torch.randn(1, 16, 90, 128, generator=g).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = decode_attention.attend(q, k, v, 0.1)
        torch.set_num_threads(2)
        twos = [decode_attention.attend(q, k, v, 0.1) for _ in range(20)]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(one, two) for two in twos)
