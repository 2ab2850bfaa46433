"""MLA decode in the latent space (DeepSeek-V2's absorbed form, ``mla.attend``): a decode step never
expands the cached latents through ``kv_b_proj``, and its logits are the expanded form's."""

import pytest
import torch
import torch.nn.functional as F

from fate_edge.model import mla
from fate_edge.model.layer import Fused
from fate_edge.runtime.loader import load_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_mla(tmp_path_factory):
    from _tiny_moe import build_tiny_mla

    return build_tiny_mla(tmp_path_factory.mktemp("mla") / "tiny-mla")


class _Expanding:
    """A dense ``kv_b_proj`` held as a callable (as a quantized linear is): ``mla_attend`` then expands the cache."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def _decode(model, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """The prompt's last logits, then one decode step per token of ``tokens`` (fed, not sampled)."""
    cache = model.new_cache()  # ids on the host, as a tokenizer's are (also under torch.device("meta"))
    steps = [model(torch.tensor([prompt], device="cpu"), cache, last_only=True)[0, -1]]
    for tok in tokens:
        steps.append(model(torch.tensor([[tok]], device="cpu"), cache)[0, -1])
    return steps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_absorbed_decode_gives_the_expanded_logits(tiny_mla, dtype):
    prompt = list(range(3, 40, 3))
    absorbed = load_model(tiny_mla, dtype=dtype)
    expanded = load_model(tiny_mla, dtype=dtype)
    for lp in expanded.plan():
        f = lp.mla["kv_b_proj"]
        lp.mla["kv_b_proj"] = Fused(_Expanding(f.weight), f.bias, f.sizes)
    tokens = list(range(50, 62))
    a, e = _decode(absorbed, prompt, tokens), _decode(expanded, prompt, tokens)
    assert torch.equal(a[0], e[0])  # the prompt expands either way
    if dtype == torch.float32:
        diff = max((x - y).abs().max().item() for x, y in zip(a, e))
        assert diff <= 1e-5, diff
        return
    # bf16: the two forms round at different places, a step or two of bf16 apart (0.016 at these logits); the bar is
    # accuracy against the float32 logits, no worse than the expanded form's over the run
    exact = _decode(load_model(tiny_mla, dtype=torch.float32), prompt, tokens)
    err_a, err_e = ([(x.float() - z).abs().max().item() for x, z in zip(steps, exact)] for steps in (a, e))
    assert max(err_a) <= 1.25 * max(err_e) and sum(err_a) <= 1.25 * sum(err_e), (err_a, err_e)


def test_a_decode_step_does_not_expand_the_cache(tiny_mla, monkeypatch):
    model = load_model(tiny_mla, dtype=torch.float32)
    kv_b = {id(lp.mla["kv_b_proj"]) for lp in model.plan()}
    rows: list[int] = []
    real = mla.apply_linear

    def spy(x, f):
        if id(f) in kv_b:
            rows.append(x.shape[-2])
        return real(x, f)

    monkeypatch.setattr(mla, "apply_linear", spy)
    cache = model.new_cache()
    model(torch.tensor([list(range(5, 25))]), cache)
    assert rows == [20] * len(model.plan())  # the prompt: every layer expands its 20 positions once
    rows.clear()
    for t in range(4):
        model(torch.tensor([[7 + t]]), cache)
    assert rows == []  # decode steps attend in the latent space
    assert cache.layers[0].buffers[0].shape[-1] == model.config.mla.kv_lora_rank + model.config.mla.qk_rope_head_dim


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_head_matvec_is_fp32_exact_from_either_side_on_strided_blocks(dtype):
    """The kernel behind the absorbed decode on the CPU: per head x @ W and W @ x over column-contiguous blocks of
    one matrix (kv_b_proj's key and value rows), as accurate as fp32 arithmetic on the stored weights."""
    from fate_edge.model import head_matvec

    if not head_matvec.available()[0]:
        pytest.skip(f"no native kernel here: {head_matvec.available()[1]}")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6 * 40, 72, generator=g).to(dtype).view(6, 40, 72)
    wk, wv = w[:, :16], w[:, 16:]  # strided views: 16 and 24 rows of each head's 40
    x, y = torch.randn(6, 16, generator=g), torch.randn(6, 72, generator=g)
    assert head_matvec.takes(wk) and head_matvec.takes(wv)
    exact_xw = torch.einsum("hr,hrc->hc", x.double(), wk.double())
    exact_wx = torch.einsum("hrc,hc->hr", wv.double(), y.double())
    for got, exact, k in ((head_matvec.x_w(x, wk), exact_xw, 16), (head_matvec.w_x(y, wv), exact_wx, 72)):
        assert got.dtype == torch.float32 and got.shape == exact.shape
        # fp32 sums of k exact products: within k roundings of fp32 of the largest partial sum
        bound = k * 2.0**-23 * exact.abs().max().item() * 4
        assert (got.double() - exact).abs().max().item() <= bound
    # several vectors (a batch's decode rows) at once: each one's bits are what it gets alone
    xs, ys = torch.randn(3, 6, 16, generator=g), torch.randn(3, 6, 72, generator=g)
    many_xw, many_wx = head_matvec.x_w(xs, wk), head_matvec.w_x(ys, wv)
    assert many_xw.shape == (3, 6, 72) and many_wx.shape == (3, 6, 24)
    for i in range(3):
        assert torch.equal(many_xw[i], head_matvec.x_w(xs[i], wk))
        assert torch.equal(many_wx[i], head_matvec.w_x(ys[i], wv))
    assert not head_matvec.takes(wk.float()) and not head_matvec.takes(w[:, :, :12])  # fp32; 12 columns
    with pytest.raises(ValueError, match="does not fit"):
        head_matvec.x_w(torch.randn(6, 15), wk)


def test_bf16_decode_takes_the_head_matvec_kernel(tiny_mla, monkeypatch):
    from fate_edge.model import head_matvec

    if not head_matvec.available()[0]:
        pytest.skip(f"no native kernel here: {head_matvec.available()[1]}")
    calls: list[str] = []
    for name in ("x_w", "w_x"):
        real = getattr(head_matvec, name)
        monkeypatch.setattr(head_matvec, name, lambda x, w, real=real, name=name: calls.append(name) or real(x, w))
    model = load_model(tiny_mla, dtype=torch.bfloat16)
    cache = model.new_cache()
    model(torch.tensor([list(range(5, 25))]), cache)
    assert calls == []  # the prompt expands
    model(torch.tensor([[7]]), cache)
    assert calls == ["x_w", "w_x"] * len(model.plan()) + ["w_x"]  # each layer's kv_b blocks, then the output head


def test_batched_bf16_decode_rows_take_one_pass_and_match_alone(tiny_mla, monkeypatch):
    """A batch's MLA decode rows on one KV slab: one attention over their ranges and one pass through each
    kv_b_proj block per layer and step (mla._slab_rows), each row's logits those it decodes alone."""
    from fate_edge.model import decode_attention, head_matvec
    from fate_edge.model.batch_step import Segment, forward_segments
    from fate_edge.model.kv_slab import KVSlab

    if not (head_matvec.available()[0] and decode_attention.available()[0]):
        pytest.skip("no native kernels here")
    model = load_model(tiny_mla, dtype=torch.bfloat16)
    prompts, tokens = [list(range(3, 15)), list(range(20, 27)), list(range(40, 49))], list(range(50, 56))
    expected = [_decode(model, p, tokens) for p in prompts]
    passes: list[int] = []
    real = decode_attention.attend_ranges
    monkeypatch.setattr(decode_attention, "attend_ranges", lambda q, *a: passes.append(q.shape[0]) or real(q, *a))
    slab = KVSlab(model, 3 * 32)
    segs = [Segment(p, slab.allocate(32)) for p in prompts]
    got = [[row] for row in forward_segments(model, segs)]
    assert passes == []  # prompts expand, per sequence
    for t in tokens:
        for seg in segs:
            seg.ids = [t]
        for j, row in enumerate(forward_segments(model, segs)):
            got[j].append(row)
    assert passes == [3] * (len(tokens) * len(model.plan()))
    # bitwise equal on this host's BLAS (0.0 measured); the projections over 3 rows instead of 1 may round differently
    # elsewhere, hence one bf16 step at these logits
    for ours, alone in zip(got, expected):
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(ours, alone))
        assert diff <= 0.05, diff


def test_mla_decode_alone_and_batched_makes_nothing_off_the_model_device(tiny_mla):
    """Under ``torch.device("meta")`` a tensor made without ``device=`` is a meta tensor (tests/test_device_placement
    .py): the absorbed decode, alone and in a batch's slab pass, gives the same logits there as outside it."""
    from fate_edge.model.batch_step import Segment, forward_segments
    from fate_edge.model.kv_slab import KVSlab

    model = load_model(tiny_mla, dtype=torch.bfloat16)
    prompts = [list(range(3, 15)), list(range(20, 27))]

    def run() -> list[torch.Tensor]:
        slab = KVSlab(model, 2 * 16)
        segs = [Segment(p, slab.allocate(16)) for p in prompts]
        rows = [forward_segments(model, segs)]
        for t in (50, 51):
            for seg in segs:
                seg.ids = [t]
            rows.append(forward_segments(model, segs))
        return [*rows, *_decode(model, prompts[0], [50, 51])]

    want = run()
    with torch.device("meta"):
        got = run()
    assert all(g.device.type == "cpu" and torch.equal(g, w) for g, w in zip(got, want))


def test_head_matvec_gives_the_bits_of_one_thread_on_two():
    """Large enough (16 heads of 128 x 512) for the kernel to use both threads, which share out heads as they come."""
    from fate_edge.model import head_matvec

    if not head_matvec.available()[0]:
        pytest.skip(f"no native kernel here: {head_matvec.available()[1]}")
    g = torch.Generator().manual_seed(4)
    w = torch.randn(16, 128, 512, generator=g).bfloat16()
    x, y = torch.randn(16, 128, generator=g), torch.randn(16, 512, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = (head_matvec.x_w(x, w), head_matvec.w_x(y, w))
        torch.set_num_threads(2)
        twos = [(head_matvec.x_w(x, w), head_matvec.w_x(y, w)) for _ in range(10)]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(one[0], a) and torch.equal(one[1], b) for a, b in twos)
