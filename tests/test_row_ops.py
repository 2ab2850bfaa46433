"""A decode row's native steps (fate_edge.model.row_ops: the MoE expert sum, rope, RMSNorm, an int8 embedding row,
greedy's argmax): the bits of the torch operators they replace, alone and in a decode step, where the step does take
them."""

from __future__ import annotations

import pytest
import torch

import fate_edge.model.routed_experts as routed_experts
from fate_edge import load_model
from fate_edge.format.file_rows import FileRows
from fate_edge.model import row_ops
from fate_edge.model.decode_step import roll_permutation, rope_matrix
from fate_edge.model.embedding import QuantizedEmbedding
from fate_edge.model.layer_step import add_moe, add_routed, add_shared, moe_sum
from fate_edge.runtime.sampling import greedy

pytestmark = pytest.mark.skipif(not row_ops.available()[0], reason=f"no native row kernel: {row_ops.available()[1]}")


def torch_sum(x, ys, ws, shared):
    """layer_step's rules, operator by operator, on a copy of ``x``."""
    x = x.clone()
    acc = moe_sum(x)
    for y, w in zip(ys, ws):
        acc = add_routed(acc, y, w)
    return add_moe(x, acc if shared is None else add_shared(acc, *shared))


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("y_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shared", ["gated", "plain", "none"])
def test_the_expert_sum_has_layer_steps_bits(x_dtype, y_dtype, shared):
    g = torch.Generator().manual_seed(7)
    for trial in range(40):
        n = (2048, 2047, 24, 5)[trial % 4]  # the vector loop, its tail, and a tail alone
        x = (torch.randn(1, n, generator=g) * 3).to(x_dtype)
        k = 1 + trial % 8
        scale = (1e-3, 1.0, 40.0)[trial % 3]
        ys = [(torch.randn(1, n, generator=g) * scale).to(y_dtype) for _ in range(k)]
        ws = torch.rand(k, generator=g).tolist()
        z = torch.randn(1, n, generator=g).to(y_dtype)
        gate = (torch.randn(1, 1, generator=g) * 2).to(y_dtype)
        parts = {"gated": (z, gate), "plain": (z, None), "none": None}[shared]
        got = x.clone()
        assert row_ops.add_experts(got, ys, ws, parts)
        assert torch.equal(got, torch_sum(x, ys, ws, parts)), f"trial {trial}"


def test_the_expert_sum_refuses_what_it_does_not_take():
    x = torch.randn(1, 64).bfloat16()
    y = torch.randn(1, 64).bfloat16()
    before = x.clone()
    assert not row_ops.add_experts(x, [], [], None)  # no expert ran: layer_step's own path
    assert not row_ops.add_experts(x, [y.half()], [0.5], None)  # fp16: not taken
    assert not row_ops.add_experts(x, [torch.randn(2, 64).bfloat16()], [0.5], None)  # two rows
    assert not row_ops.add_experts(x, [torch.randn(64, 2).bfloat16().t()[:1]], [0.5], None)  # not contiguous
    assert torch.equal(x, before)  # nothing written where refused


def test_rope_rows_have_the_rotation_matrixs_bits():
    g = torch.Generator().manual_seed(3)
    for d in (128, 64, 6):
        perm = roll_permutation(d, torch.bfloat16)
        sign = torch.where(torch.arange(d) < d // 2, -1.0, 1.0)
        for trial in range(30):
            angle = torch.rand(1, d, generator=g) * 4000
            cos, sin = angle.cos().bfloat16(), (angle.sin() * sign).bfloat16()
            # 1e-37: products below float32's normal range, where a fused multiply-add would round differently
            qk = (torch.randn(24, d, generator=g) * (0.01, 1.0, 60.0, 1e-37)[trial % 4]).bfloat16()
            want = torch.mm(qk.float(), rope_matrix(cos, sin, perm).float()).to(torch.bfloat16)
            assert torch.equal(row_ops.rope_(qk.clone(), row_ops.RopeRows(cos, sin)), want)
            # with a fused projection's bias: added to the whole row (q, k and then v) as ``flat + bias`` rounds
            flat = (torch.randn(30 * d, generator=g) * 3).bfloat16()
            bias = torch.randn(30 * d, generator=g).bfloat16()
            biased = flat + bias
            want = torch.mm(biased[: 24 * d].view(24, d).float(), rope_matrix(cos, sin, perm).float()).bfloat16()
            got = flat.clone()
            row_ops.rope_(got[: 24 * d].view(24, d), row_ops.RopeRows(cos, sin), (got, bias))
            assert torch.equal(got[: 24 * d].view(24, d), want) and torch.equal(got[24 * d :], biased[24 * d :])


@pytest.mark.parametrize("threads", [1, 2])
def test_rms_norm_rows_have_torchs_bits(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(11)
        # the kernel's cascade of sums changes shape with the length: short rows, tails, and the longest it takes
        for n in (1, 7, 8, 31, 128, 192, 2047, 2048, 4096, 5632, 7168, 12345, row_ops.RMS_NORM_MAX):
            for scale in (1e-20, 1e-3, 1.0, 40.0, 3e4):
                x = (torch.randn(1, n, generator=g) * scale).bfloat16()
                w = (1 + 0.1 * torch.randn(n, generator=g)).bfloat16()
                want = w * torch.nn.functional.rms_norm(x.float(), (n,), None, 1e-6).bfloat16()
                assert torch.equal(row_ops.rms_norm_row(x, w, 1e-6), want), (n, scale)
    finally:
        torch.set_num_threads(before)
    assert row_ops.rms_norm_row(torch.randn(2, 64).bfloat16(), torch.ones(64).bfloat16(), 1e-6) is None  # 2 rows
    too_long = row_ops.RMS_NORM_MAX + 8
    assert row_ops.rms_norm_row(torch.randn(1, too_long).bfloat16(), torch.ones(too_long).bfloat16(), 1e-6) is None


def test_the_head_norm_has_the_bits_of_torchs_norm_over_a_row_of_heads():
    """Qwen3's per-head q and k norms in place (``row_ops.head_norm_at``) against ``layer.rms_norm`` on the [heads, d]
    q and k, the general path's operator."""
    from fate_edge.model.layer import rms_norm

    g = torch.Generator().manual_seed(12)
    for d, nq, nk in ((64, 2, 1), (128, 32, 4), (128, 16, 16), (256, 8, 2)):
        for scale in (1e-3, 1.0, 40.0):
            rows = (torch.randn(nq + nk, d, generator=g) * scale).bfloat16()
            qw, kw = ((1 + 0.1 * torch.randn(d, generator=g)).bfloat16() for _ in range(2))
            want = torch.cat(
                [
                    rms_norm(rows[:nq].view(1, 1, nq, d), qw, 1e-6).view(nq, d),
                    rms_norm(rows[nq:].view(1, 1, nk, d), kw, 1e-6).view(nk, d),
                ]
            )
            got = rows.clone()
            row_ops.head_norm_at(got.data_ptr(), nq, nk, d, qw, kw, 1e-6)
            assert torch.equal(got, want), (d, nq, nk, scale)


def test_argmax_over_bf16_logits_is_torchs():
    g = torch.Generator().manual_seed(13)
    for trial in range(120):
        n = (151936, 1, 7, 256, 257, 1000)[trial % 6]
        x = (torch.randn(n, generator=g) * (1.0, 1e-3, 100.0)[trial % 3]).bfloat16()
        if trial % 4 == 1:
            x = x.round()  # ties: the first index of the largest
        if trial % 5 == 2:
            x[torch.randint(0, n, (2,), generator=g)] = float("nan")  # the first NaN counts as largest
        if trial % 7 == 3:
            x.zero_()
            x[n // 2 :] = -0.0  # -0 and +0 compare equal
        if trial % 9 == 4:
            x.fill_(float("-inf"))
        assert row_ops.argmax_bf16(x) == int(torch.argmax(x)), trial
        assert greedy(x[None]) == int(torch.argmax(x))
    assert row_ops.argmax_bf16(torch.randn(8)) is None  # float32: numpy's


def test_an_int8_embedding_row_read_from_the_store_has_the_gathers_bits(tmp_path, monkeypatch):
    table = torch.randint(-128, 128, (300, 192), dtype=torch.int8)
    scale = (torch.rand(300) * 0.1).bfloat16()
    path = tmp_path / "table.bin"
    path.write_bytes(b"x" * 24 + table.numpy().tobytes() + scale.view(torch.uint16).numpy().tobytes())
    codes = FileRows(path, 24, (300, 192), torch.int8)
    scales = FileRows(path, 24 + table.numel(), (300,), torch.bfloat16)
    native = row_ops.embed_int8_row
    calls = []
    monkeypatch.setattr(row_ops, "embed_int8_row", lambda *a: calls.append(a[2]) or native(*a))
    for dtype in (torch.bfloat16, torch.float32):
        emb = QuantizedEmbedding(8, table, scale, None, dtype, (codes, scales))
        for row in (0, 1, 150, 299):
            want = (table[row].float() * scale[row].float()).to(dtype)[None]
            assert torch.equal(row_ops.embed_int8_row(codes, scales, row, dtype), want)
            assert torch.equal(emb(torch.tensor([row])), want)
    assert calls == [0, 0, 1, 1, 150, 150, 299, 299] * 2  # each row: the direct call, then the table's own
    assert torch.equal(emb(torch.tensor([3, 3, 7])), (table[[3, 3, 7]].float() * scale[[3, 3, 7]].float()[:, None]))
    with pytest.raises(IndexError, match="300"):
        row_ops.embed_int8_row(codes, scales, 300, torch.bfloat16)
    short = tmp_path / "short.bin"
    short.write_bytes(path.read_bytes()[: 24 + 299 * 192])  # the last row and the scales cut off
    cut = FileRows(short, 24, (300, 192), torch.int8)
    with pytest.raises(OSError, match="truncated"):
        row_ops.embed_int8_row(cut, FileRows(short, 24 + table.numel(), (300,), torch.bfloat16), 299, torch.bfloat16)


def bf16_decode(model, steps: int = 6) -> torch.Tensor:
    prompt = torch.tensor([[5, 300, 17, 2048, 99, 1000]], device="cpu")  # the host's, under any default device
    cache = model.new_cache()
    out = []
    with torch.inference_mode():
        tok = model(prompt, cache)[:, -1:].argmax(-1)
        for _ in range(steps):
            logits = model(tok, cache)
            out.append(logits)
            tok = logits[:, -1:].argmax(-1)
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("resident_bits", [None, 4], ids=["bf16 rest", "int4 rest"])
def test_a_bf16_decode_step_takes_the_native_steps_with_torchs_bits(
    bundled_dir, one_thread, monkeypatch, resident_bits
):
    model = load_model(bundled_dir, torch.bfloat16, resident_bits=resident_bits)
    # the bundled model's q/k/v bias: added in rope's call where the projection is int4 (the bench's sides)
    assert model.plan()[0].qkv.bias is not None
    calls = {"sum": 0, "rope": 0, "norm": 0}
    add_experts, rope_, rms_norm_row = row_ops.add_experts, row_ops.rope_, row_ops.rms_norm_row

    def counted_norm(*args):
        out = rms_norm_row(*args)
        calls["norm"] += out is not None
        return out

    def counted_sum(*args):
        done = add_experts(*args)
        calls["sum"] += done
        return done

    def counted_rope(*args):
        calls["rope"] += 1
        return rope_(*args)

    monkeypatch.setattr(routed_experts, "add_experts", counted_sum)
    monkeypatch.setattr(row_ops, "rope_", counted_rope)
    monkeypatch.setattr(row_ops, "rms_norm_row", counted_norm)
    native = bf16_decode(model)
    layers = model.config.num_hidden_layers
    want = {"sum": 6 * layers, "rope": 6 * layers, "norm": 6 * (2 * layers + 1)}  # two a layer and the final one
    assert calls == want  # every decode layer took all three
    monkeypatch.setattr(row_ops, "available", lambda: (False, "turned off for the comparison"))
    model = load_model(bundled_dir, torch.bfloat16, resident_bits=resident_bits)  # a fresh one: no state carried
    assert torch.equal(bf16_decode(model), native)
    assert calls == want  # torch's operators, no native call


def test_a_decode_under_a_meta_default_device_gives_the_same_tokens(bundled_dir, one_thread):
    """Every tensor the native steps write is made on the host, whatever the default device is: the embedding row's
    buffer made on the default (meta) device had no memory, and the kernel's write into it killed the process."""
    from fate_edge.format.converted_stores import ensure_store

    store = ensure_store(bundled_dir, progress=False)  # the default store: an int8 embedding table read by row
    model = load_model(store, torch.bfloat16, resident_bits=4)
    assert isinstance(model.embed.rows[0], row_ops.FileTable)  # its rows read by the native call
    want = bf16_decode(model).argmax(-1)
    with torch.device("meta"):
        got = bf16_decode(model).argmax(-1)
    assert torch.equal(got, want)


LOAD_THEN_LOOK = """
from fate_edge import load_model
from fate_edge.bundled import bundled_model_dir
from fate_edge.model import decode_attention, head_matvec, row_ops

before = [k._kernel._reason for k in (row_ops, decode_attention, head_matvec)]
load_model(bundled_model_dir())
after = [k._kernel._reason for k in (row_ops, decode_attention, head_matvec)]
print(before == [None] * 3, None not in after, after)
"""


def test_a_cpu_model_load_loads_the_decode_kernels_before_its_first_request():
    """Each kernel's first use asks the compiler its version and opens a library (milliseconds): a fresh process's
    load does it, so a first prompt does not (its tokens per second are what a user meets first)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", LOAD_THEN_LOOK], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-800:]
    fresh, tried, after = done.stdout.strip().split(" ", 2)
    assert fresh == "True"  # nothing loaded them at import
    assert tried == "True", f"a kernel left to the first request: {after}"  # loaded, or refused for a reason
