"""convert --resident-bits / --embedding-bits: resident linears and the embedding table quantized once at convert
and read back as they are (fate_edge/format/prequantized.py); stores written without the options still load."""

from pathlib import Path

import pytest
import torch

import fate_edge.runtime.loader as loader
from fate_edge import load_model
from fate_edge.errors import ModelFormatError
from fate_edge.format.checkpoint import CheckpointReader
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.huge_pages import THP_SETTING
from fate_edge.runtime.memory_account import memory_account

IDS = torch.tensor([[5, 900, 33, 4000, 12, 77, 2048, 3, 64, 1]])


@pytest.fixture(scope="module")
def stores(tmp_path_factory, bundled_dir):
    root = tmp_path_factory.mktemp("pq")
    opts = dict(bits=4, keep_bf16=False)
    return {
        None: convert(bundled_dir, root / "float", ConvertOptions.full(**opts), progress=False),
        4: convert(
            bundled_dir, root / "int4", ConvertOptions.full(**opts, resident_bits=4, embedding_bits=4), progress=False
        ),
        8: convert(
            bundled_dir, root / "int8", ConvertOptions.full(**opts, resident_bits=8, embedding_bits=8), progress=False
        ),
    }


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS, model.new_cache())


@pytest.mark.parametrize("bits", [8, 4])
def test_a_prequantized_store_loads_without_quantizing_and_computes_what_load_time_quantizing_does(
    stores, bits, monkeypatch, one_thread
):
    expected = _logits(load_model(stores[None], resident_bits=bits, embedding_bits=bits))

    def refuse(*args, **kwargs):
        raise AssertionError("quantized at load")

    monkeypatch.setattr(loader, "quantize_group", refuse)
    monkeypatch.setattr(loader, "quantize_table", refuse)
    model = load_model(stores[bits])  # nothing asked: the store says what it holds
    torch.testing.assert_close(_logits(model), expected, rtol=0, atol=0)
    names = CheckpointReader(stores[bits]).keys()
    assert not [n for n in names if n.endswith(("q_proj.weight", "lm_head.weight", "embed_tokens.weight"))]


def test_the_prequantized_store_is_smaller_and_its_load_holds_no_float_copy(stores):
    floats = (stores[None] / "resident.safetensors").stat().st_size
    assert (stores[4] / "resident.safetensors").stat().st_size < 0.3 * floats
    at_load = memory_account(stores[None], 3_000_000, "float32", 256, resident_bits=4, embedding_bits=4)
    converted = memory_account(stores[4], 3_000_000, "float32", 256)
    assert converted.embeddings + converted.other_resident == at_load.embeddings + at_load.other_resident
    held = converted.embeddings + converted.other_resident
    assert converted.loading - held < 0.01 * held  # beyond what stays: at most a small tensor being cast
    assert at_load.loading > converted.loading


def test_asking_a_prequantized_store_for_other_bits_names_the_fixes(stores):
    with pytest.raises(ModelFormatError, match="quantized to int4 at convert; load with --resident-bits 4"):
        load_model(stores[4], resident_bits=8)
    with pytest.raises(ModelFormatError, match="load with --embedding-bits 4"):
        load_model(stores[4], embedding_bits=8)


def _mapped_file(ptr: int) -> str | None:
    """The file mapped at address ``ptr`` in this process (/proc/self/maps), or None for anonymous memory."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= ptr < hi:
                return parts[5] if len(parts) > 5 else None
    return None


def test_the_quantized_weights_are_memory_mapped_from_the_store(stores):
    model = load_model(stores[4])
    resident = str(stores[4] / "resident.safetensors")
    codes = [k for k in model.w if k.endswith((".int4", ".nint4"))]
    assert codes and all(_mapped_file(model.w[k].data_ptr()) == resident for k in codes)
    assert _mapped_file(model.embed.codes.data_ptr()) == resident
    float_store = load_model(stores[None], resident_bits=4)  # quantized at load: the process's own memory
    assert _mapped_file(
        float_store.w["lm_head.int4" if "lm_head.int4" in float_store.w else codes[0]].data_ptr()
    ) != str(stores[None] / "resident.safetensors")


@pytest.mark.skipif(not Path(THP_SETTING).exists() or "[never]" in Path(THP_SETTING).read_text(), reason="needs THP")
def test_large_streamed_codes_leave_the_mapping_for_huge_pages_and_the_rest_stay_mapped(tmp_path):
    """``MappedFiles.get(streamed=True)``: int4 codes large enough to gain (an ``lm_head``'s) are copied onto huge
    pages and no longer read through the file's mapping; small ones, and anything not streamed, stay mapped."""
    from safetensors.torch import save_file

    from fate_edge.format.prequantized import MappedFiles

    big = torch.randint(0, 255, (1024, 6 * 1024), dtype=torch.uint8)
    small = torch.randint(0, 255, (64, 64), dtype=torch.uint8)
    save_file({"lm_head.nint4": big, "o_proj.nint4": small}, str(tmp_path / "model.safetensors"))
    mapped = MappedFiles(CheckpointReader(tmp_path))
    moved, kept = mapped.get("lm_head.nint4", streamed=True), mapped.get("o_proj.nint4", streamed=True)
    assert torch.equal(moved, big) and torch.equal(kept, small)
    assert _mapped_file(moved.data_ptr()) is None and moved.data_ptr() % (2 << 20) == 0  # anonymous, 2 MB aligned
    file = str(tmp_path / "model.safetensors")
    assert _mapped_file(kept.data_ptr()) == file and _mapped_file(mapped.get("lm_head.nint4").data_ptr()) == file


@pytest.mark.parametrize("bits", [8, 4])
def test_the_prequantized_table_is_read_by_row_from_the_store_not_through_its_mapping(stores, bits, one_thread):
    model = load_model(stores[bits])
    assert model.embed.rows is not None
    expected = _logits(model)
    # the mapping's bytes no longer matter: every row the tokens use comes from the file
    model.embed.codes, model.embed.scale = torch.zeros_like(model.embed.codes), torch.zeros_like(model.embed.scale)
    torch.testing.assert_close(_logits(model), expected, rtol=0, atol=0)
    assert memory_account(stores[bits], 3_000_000, "float32", 256).embeddings_held == 0


def test_inspect_counts_the_weights_the_codes_stand_for(stores):
    from fate_edge.format.inspect_model import summarize

    floats, quantized = summarize(stores[None]), summarize(stores[4])
    assert abs(quantized.resident_params / floats.resident_params - 1) < 0.01  # int4 rows padded for the kernel
    assert quantized.resident_bytes < 0.3 * floats.resident_bytes


def test_the_emulated_token_reads_the_same_bytes_whether_quantized_at_convert_or_at_load(stores):
    from fate_edge.planning.emulation import decode_token_work

    at_load, at_convert = decode_token_work(stores[None], 4, 4), decode_token_work(stores[4], 4)
    assert abs(at_convert.bytes / at_load.bytes - 1) < 0.02  # int4 rows padded for torch's kernel, bf16 scales
    assert "int4 linears" in at_convert.what


def test_the_older_memory_need_reads_a_prequantized_store(stores):
    """footprint.memory_need (the scale bench's cgroup cap) counts what a store quantized at convert holds."""
    from fate_edge.runtime.footprint import memory_need
    from fate_edge.runtime.memory_account import memory_account

    store = stores[4]
    need = memory_need(store, 2_000_000, "float32", 64, resident_bits=4)
    account = memory_account(store, 2_000_000, "float32", 64, resident_bits=4, runtime=0)
    assert need.resident_bytes == account.embeddings + account.other_resident


def test_int8_codes_that_start_off_a_16_byte_boundary_are_realigned_not_crashed_on():
    """torch's int8 kernel segfaulted on an AVX-512 Xeon for codes starting 1-12 bytes past a 16-byte boundary, as a
    store's memory-mapped tensors may: the layer copies such codes once into an aligned allocation."""
    from fate_edge.quant.int8 import Int8Linear, quantize_int8

    w = torch.randn(576, 192)
    codes, scale = quantize_int8(w)
    x = torch.randn(3, 192)
    want = Int8Linear(codes, scale)(x)
    for offset in (1, 4, 8, 12):
        buf = torch.empty(codes.numel() + 64, dtype=torch.int8)
        view = buf[offset : offset + codes.numel()].view(codes.shape)
        view.copy_(codes)
        lin = Int8Linear(view, scale)
        assert lin.codes.data_ptr() % 16 == 0
        assert torch.equal(lin(x), want)


@pytest.mark.slow
def test_embedding_bits_alone_quantize_the_table_and_leave_the_linears_as_stored(tmp_path, bundled_dir):
    """``embedding_bits`` without ``resident_bits``: only the embedding table is quantized (the linears went to int8
    when the missing resident bits reached the group quantizer as None)."""
    out = convert(
        bundled_dir,
        tmp_path / "s",
        ConvertOptions(bits=4, keep_bf16=False, resident_bits=None, embedding_bits=8),
        progress=False,
    )
    quantized = {n for n in CheckpointReader(out).keys() if n.endswith((".int8", ".nint4", ".int4"))}
    assert quantized == {"model.embed_tokens.int8"}
    model = load_model(out)
    try:
        assert torch.isfinite(_logits(model)).all()
    finally:
        model.experts.close()
