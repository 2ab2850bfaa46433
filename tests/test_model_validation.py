"""Every model source is checked before anything is allocated or written: a bad count, size, shape or file is one
line naming the file and the key or tensor, exit 2, and nothing left behind (the audit's cases, one each)."""

import json
import os
import shutil
import struct
from dataclasses import replace

import pytest
from _gguf_rewrite import parse, rewrite
from _gguf_writer import write_gguf

from fate_edge.apps.cli import main

ARCH = "qwen2moe"


@pytest.fixture(scope="module")
def gguf(tmp_path_factory, bundled_dir):
    path = write_gguf(bundled_dir, tmp_path_factory.mktemp("g") / "m.gguf", "Q4_0")
    return parse(path)


def _convert_fails(tmp_path, src, capsys, *words: str) -> str:
    out = tmp_path / "out"
    before = set(tmp_path.iterdir())
    assert main(["convert", str(src), str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)
    assert set(tmp_path.iterdir()) == before  # nothing written
    return err


def _with(gguf, **changes):
    fields = dict(gguf.header.fields)
    for k, v in changes.items():
        key = k.replace("__", ".")
        if v is None:
            fields.pop(key, None)
        else:
            fields[key] = v
    return fields


@pytest.mark.parametrize(
    "key,value,words",
    [
        (f"{ARCH}.block_count", 2**40, ["block_count", str(2**40), "expected 1..1024"]),
        (f"{ARCH}.block_count", 0, ["block_count", "is 0"]),
        (f"{ARCH}.attention.head_count", 0, ["head_count", "is 0"]),
        (f"{ARCH}.attention.head_count", 2**40, ["head_count", str(2**40)]),
        (f"{ARCH}.expert_used_count", 0, ["expert_used_count", "is 0"]),
        (f"{ARCH}.expert_used_count", 99, ["99 experts per token", "16 experts"]),
        (f"{ARCH}.embedding_length", "wide", ["embedding_length", "not an integer"]),
        ("tokenizer.ggml.tokens", [], ["tokenizer.ggml.tokens is empty"]),
        ("general.alignment", 0, ["general.alignment is 0"]),
    ],
)
def test_a_bad_gguf_count_is_one_line_naming_the_key(key, value, words, gguf, tmp_path, capsys):
    fields = dict(gguf.header.fields)
    fields[key] = value
    src = rewrite(gguf, tmp_path / "bad.gguf", fields=fields)
    _convert_fails(tmp_path, src, capsys, str(src), *words)


def _tensor(gguf, name):
    return next(i for i, t in enumerate(gguf.header.tensors) if t.name == name)


def test_an_expert_tensor_with_a_zero_dimension_is_named(gguf, tmp_path, capsys):
    tensors = list(gguf.header.tensors)
    i = _tensor(gguf, "blk.0.ffn_up_exps.weight")
    tensors[i] = replace(tensors[i], dims=(tensors[i].dims[0], 0, tensors[i].dims[2]))
    src = rewrite(gguf, tmp_path / "bad.gguf", tensors=tensors)
    _convert_fails(tmp_path, src, capsys, "blk.0.ffn_up_exps.weight", "at least 1")


def test_a_misaligned_tensor_offset_is_found_at_load_not_as_nan_weights(gguf, tmp_path, capsys):
    tensors = list(gguf.header.tensors)
    i = _tensor(gguf, "blk.1.ffn_down_exps.weight")
    tensors[i] = replace(tensors[i], offset=tensors[i].offset + 2)
    src = rewrite(gguf, tmp_path / "bad.gguf", tensors=tensors)
    _convert_fails(tmp_path, src, capsys, "blk.1.ffn_down_exps.weight", "alignment 32")


def test_swapped_expert_shapes_are_refused_at_convert(gguf, tmp_path, capsys):
    tensors = list(gguf.header.tensors)
    i = _tensor(gguf, "blk.0.ffn_down_exps.weight")
    e, rows, cols = reversed(tensors[i].dims)  # ggml's order is reversed
    tensors[i] = replace(tensors[i], dims=(rows, cols, e))  # columns and rows swapped: [E, I, H] for [E, H, I]
    src = rewrite(gguf, tmp_path / "bad.gguf", tensors=tensors)
    _convert_fails(tmp_path, src, capsys, "blk.0.ffn_down_exps.weight", "has shape", "expected")


def test_a_zero_byte_gguf_is_named_as_such(tmp_path, capsys):
    src = tmp_path / "empty.gguf"
    src.write_bytes(b"")
    err = _convert_fails(tmp_path, src, capsys, str(src))
    assert "config.json" not in err


def _config_dir(tmp_path, bundled_dir, **changes):
    d = tmp_path / "model"
    shutil.copytree(bundled_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize(
    "changes,words",
    [
        ({"num_hidden_layers": 2**40}, ["'num_hidden_layers' is 1099511627776", "expected 1..1024"]),
        ({"num_hidden_layers": 0}, ["'num_hidden_layers' is 0"]),
        ({"num_attention_heads": 0}, ["'num_attention_heads' is 0"]),
        ({"num_experts_per_tok": 99}, ["99 experts per token"]),
        ({"num_experts": "16"}, ["'num_experts' is '16', not an integer"]),
        ({"num_key_value_heads": 3}, ["not a multiple of 3 key/value heads"]),
        ({"mlp_only_layers": list(range(8))}, ["none of its 8 layers has experts"]),
        ({"rms_norm_eps": -1}, ["'rms_norm_eps' is -1"]),
    ],
)
def test_a_bad_config_json_is_one_line_naming_the_key(changes, words, tmp_path, bundled_dir, capsys):
    d = _config_dir(tmp_path, bundled_dir, **changes)
    _convert_fails(tmp_path, d, capsys, str(d / "config.json"), *words)


def test_a_config_that_is_a_json_list_is_named(tmp_path, bundled_dir, capsys):
    d = _config_dir(tmp_path, bundled_dir)
    (d / "config.json").write_text("[1, 2]")
    _convert_fails(tmp_path, d, capsys, "config.json", "JSON list")


def test_a_fifo_as_tokenizer_json_is_refused_without_blocking(tmp_path, bundled_dir, capsys):
    d = _config_dir(tmp_path, bundled_dir)
    (d / "tokenizer.json").unlink()
    os.mkfifo(d / "tokenizer.json")
    import threading

    from fate_edge.errors import ModelFormatError
    from fate_edge.tokenizer import Tokenizer

    outcome: list[BaseException | None] = []

    def load():
        try:
            Tokenizer(d)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # unblock the reader: a writer opens the FIFO and closes it
        with open(d / "tokenizer.json", "w"):
            pass
        pytest.fail("loading the tokenizer blocked on the FIFO")
    assert isinstance(outcome[0], ModelFormatError) and "not a regular file" in str(outcome[0])


def test_a_safetensors_header_that_is_a_json_list_is_named(tmp_path, bundled_dir, capsys):
    d = _config_dir(tmp_path, bundled_dir)
    header = b"[1, 2, 3]"
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    _convert_fails(tmp_path, d, capsys, "model.safetensors", "not an object")


@pytest.mark.parametrize(
    "entry,words",
    [
        ({"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 1 << 40]}, ["data_offsets", "past the end"]),
        ({"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 8]}, ["16 bytes", "data_offsets"]),
        ({"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}, ["dtype 'Q9'"]),
        ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 8]}, ["shape"]),
        ({"dtype": "F32", "shape": [2]}, ["data_offsets"]),
    ],
)
def test_a_bad_safetensors_entry_is_named(entry, words, tmp_path, bundled_dir, capsys):
    d = _config_dir(tmp_path, bundled_dir)
    header = json.dumps({"model.norm.weight": entry}).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    _convert_fails(tmp_path, d, capsys, "model.safetensors", "model.norm.weight", *words)


def test_an_index_naming_a_shard_outside_the_model_is_refused(tmp_path, bundled_dir, capsys):
    d = _config_dir(tmp_path, bundled_dir)
    outside = tmp_path / "outside.safetensors"
    shutil.move(d / "model.safetensors", outside)
    from safetensors import safe_open

    with safe_open(str(outside), framework="pt") as f:
        names = list(f.keys())
    index = {"metadata": {}, "weight_map": {n: "../outside.safetensors" for n in names}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    _convert_fails(tmp_path, d, capsys, "model.safetensors.index.json", "../outside.safetensors", "inside")


def test_a_transposed_expert_in_a_safetensors_checkpoint_is_refused_at_convert(tmp_path, bundled_dir, capsys):
    from safetensors.torch import load_file, save_file

    d = _config_dir(tmp_path, bundled_dir)
    w = load_file(d / "model.safetensors")
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    w[name] = w[name].t().contiguous()
    save_file(w, d / "model.safetensors", metadata={"format": "pt"})
    _convert_fails(tmp_path, d, capsys, name, "has shape [128, 192], expected [192, 128]")
