"""Quantized embedding tables (fate_edge/model/embedding.py): rows gathered from int8-per-row or int4-per-group codes,
within the quantization step of the float rows, through prefill and decode alike, at the bytes the account counts."""

import pytest
import torch

from fate_edge import load_model
from fate_edge.model.embedding import QuantizedEmbedding, quantize_table, quantized_bytes
from fate_edge.runtime.generate import GenerateConfig, generate_from_model
from fate_edge.runtime.memory_account import memory_account


def _table(v=300, h=256, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(v, h, generator=g) * torch.rand(v, 1, generator=g) * 0.1).to(torch.bfloat16)


@pytest.mark.parametrize("bits", [8, 4])
def test_gathered_rows_are_within_half_a_step_of_the_float_rows(bits):
    w = _table()
    q = quantize_table(lambda a, b: w[a:b], tuple(w.shape), bits)
    table = QuantizedEmbedding(bits, *(list(q.values())[:3] if bits == 4 else [*q.values(), None]), torch.float32)
    ids = torch.tensor([0, 299, 17, 17, 150])
    rows = table(ids)
    assert rows.shape == (5, 256) and rows.dtype == torch.float32
    if bits == 8:
        step = table.scale.float()[ids][:, None]
    else:
        step = table.scale.float()[ids].repeat_interleave(256 // table.scale.shape[1], dim=1)
    assert ((rows - w[ids].float()).abs() <= step / 2 + 1e-6).all()
    assert table.nbytes == quantized_bytes((300, 256), bits) - (8 if bits == 4 else 0)  # the group is a 0-d tensor
    assert table.nbytes < (0.55 if bits == 8 else 0.3) * w.numel() * 2


def test_a_width_no_group_divides_is_refused_with_the_fix():
    w = _table(h=48)
    with pytest.raises(ValueError, match="not a multiple of 32; use --embedding-bits 8"):
        quantize_table(lambda a, b: w[a:b], tuple(w.shape), 4)
    with pytest.raises(ValueError, match="embedding_bits must be 8 or 4"):
        quantize_table(lambda a, b: w[a:b], tuple(w.shape), 3)


@pytest.mark.parametrize("bits", [8, 4])
def test_the_model_reads_the_quantized_table_in_prefill_and_decode(bundled_dir, bits, one_thread):
    """Same logits and the same greedy tokens as the float model given the dequantized table: the gather is the
    only difference, on both the prefill path and the one-token decode path."""
    quantized = load_model(bundled_dir, embedding_bits=bits)
    assert isinstance(quantized.embed, QuantizedEmbedding) and "model.embed_tokens.weight" not in quantized.w
    reference = load_model(bundled_dir)
    float_embed = reference.embed.clone()
    vocab = reference.config.vocab_size
    reference.embed = quantized.embed(torch.arange(vocab))  # the table the codes stand for
    assert not torch.equal(reference.embed, float_embed)  # quantizing changed it: the check below can fail
    ids = torch.tensor([[5, 900, 33, 4000, 12, 77, 2048, 3]])
    with torch.no_grad():
        a = quantized(ids, quantized.new_cache())
        b = reference(ids, reference.new_cache())
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    from fate_edge import Tokenizer

    tok = Tokenizer(bundled_dir)
    cfg = GenerateConfig(max_tokens=12, ignore_eos=True)
    assert (
        generate_from_model(quantized, tok, "def main():", cfg)[0]
        == generate_from_model(reference, tok, "def main():", cfg)[0]
    )


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_the_account_counts_the_table_the_engine_holds(bundled_dir, tmp_path, bits, one_thread):
    from fate_edge.format.convert import ConvertOptions, convert
    from fate_edge.runtime.engine import Engine
    from fate_edge.runtime.engine_config import EngineConfig

    store = convert(bundled_dir, tmp_path / "s", ConvertOptions.full(bits=4, keep_bf16=False), progress=False)
    account = memory_account(store, 3_000_000, "bfloat16", 100, embedding_bits=bits)
    with Engine(EngineConfig(store, 3_000_000, "lru", dtype="bfloat16", embedding_bits=bits)) as engine:
        loaded = sum(t.numel() * t.element_size() for t in engine.model.w.values())
        embed = engine.model.embed
        held = embed.nbytes if bits else embed.numel() * embed.element_size()
    assert account.embeddings + account.other_resident == loaded
    assert abs(account.embeddings - held) <= 8  # the int4 group size is a 0-d int64 in the resident weights


@pytest.mark.parametrize("bits", [8, 4])
def test_a_tied_head_multiplies_by_the_table_the_codes_stand_for(bits):
    from fate_edge.model.embedding import embedding_table
    from fate_edge.model.layer import Weights, apply_linear, build_head

    w = _table(v=320, h=256, seed=1)
    table = embedding_table(quantize_table(lambda a, b: w[a:b], tuple(w.shape), bits), torch.float32)
    head = build_head(Weights(), table)  # no lm_head: tied to the embedding
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
    y = apply_linear(x, head)
    reference = x @ table(torch.arange(320)).T
    assert y.shape == (3, 320)
    # the kernels take bf16 activations: within bf16 rounding of the exact product, far below the codes' own error
    assert (y - reference).abs().max() <= 0.01 * reference.abs().max()
    assert (y - x @ w.float().T).abs().max() > (y - reference).abs().max()  # the codes, not the float table


def test_a_tied_int4_head_on_the_native_kernel_reads_the_table_without_a_copy():
    """Unpacking the table and packing it again for the head cost ERNIE-4.5's 103,424 x 2,560 table 1.8 s and
    1.9 GB of peak memory at the first forward: the native kernel reads the table's own bytes."""
    from fate_edge.quant.native import native_is_default

    from fate_edge.model.embedding import embedding_table
    from fate_edge.model.layer import Weights, apply_linear, build_head

    if not native_is_default():
        pytest.skip("fate-edge's native int4 kernel is not the default on this host")
    w = _table(v=320, h=256, seed=3)
    table = embedding_table(quantize_table(lambda a, b: w[a:b], tuple(w.shape), 4), torch.float32)
    head = build_head(Weights(), table)
    assert head.weight.native.codes.data_ptr() == table.codes.data_ptr()
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    reference = x @ table(torch.arange(320)).T
    assert (apply_linear(x, head) - reference).abs().max() <= 0.01 * reference.abs().max()
