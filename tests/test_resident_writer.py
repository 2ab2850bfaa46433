"""convert writes the quantized resident part a group at a time (a large matrix a block of rows at a time, spilled
to a scratch file): the same bytes as quantizing everything in memory and saving it with safetensors."""

from __future__ import annotations

import json

import pytest
from _tiny_moe import build_wide_moe

from fate_edge.format.checkpoint import CheckpointReader
from fate_edge.format.checkpoint_layout import layer_names, resident_weight_names
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.format.prequantized import quantized_resident, write_quantized_resident
from fate_edge.format.resident_writer import _quantized_group, held
from fate_edge.model.arch import load_config


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    model = build_wide_moe(tmp_path_factory.mktemp("rw") / "model", 256)
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return model


@pytest.mark.parametrize("model_name", ["bundled", "wide"])
@pytest.mark.parametrize("bits", [4, 8])
def test_streamed_resident_part_is_the_bytes_of_the_held_one(
    model_name, bits, bundled_dir, wide, tmp_path, monkeypatch
):
    model = bundled_dir if model_name == "bundled" else wide
    monkeypatch.setattr("fate_edge.format.resident_writer.STREAM_CHUNK_BYTES", 64 << 10)  # lm_head in row blocks
    opts = ConvertOptions(resident_bits=bits, embedding_bits=bits, head_bits=None)
    store = convert(model, tmp_path / "store", opts, progress=False)
    cfg, reader = load_config(model), CheckpointReader(model)
    held = quantized_resident(cfg, reader, layer_names(cfg, reader), resident_weight_names(cfg, reader), bits, bits)
    write_quantized_resident(tmp_path / "held.safetensors", held)
    assert (store / "resident.safetensors").read_bytes() == (tmp_path / "held.safetensors").read_bytes()
    assert not list(store.glob("*.spill"))


def test_a_large_matrix_is_quantized_in_row_blocks_to_the_same_tensors(wide, monkeypatch):
    reader = CheckpointReader(wide)
    whole = held(_quantized_group(reader, ["lm_head"], 4), reader)
    monkeypatch.setattr("fate_edge.format.resident_writer.STREAM_CHUNK_BYTES", 16 << 10)
    items = list(_quantized_group(reader, ["lm_head"], 4))
    assert len(items) == 1 and items[0].rows == reader.shape("lm_head.weight")[0]  # one Blocks: row blocks
    blocks = held(iter(items), reader)
    assert whole.keys() == blocks.keys()
    assert all(whole[k].dtype == blocks[k].dtype and whole[k].equal(blocks[k]) for k in whole)
