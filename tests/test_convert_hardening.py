"""convert and the store on bad ground: group choice, full disk, killed converts, damaged store.json, file modes."""

import errno
import json
import os
import shutil
import stat

import pytest
from _tiny_moe import build_tokenizer

from fate_edge import ModelFormatError
from fate_edge.apps.cli import main
from fate_edge.errors import FateEdgeError
from fate_edge.format.convert import ConvertOptions, convert, pick_group
from fate_edge.format.store import ExpertStore


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory, bundled_dir):
    return convert(
        bundled_dir, tmp_path_factory.mktemp("st") / "s", ConvertOptions.full(bits=4, cold_bits=2), progress=False
    )


@pytest.fixture(scope="module")
def width96(tmp_path_factory):
    """A Qwen2-MoE checkpoint whose expert width (96) is a multiple of 32 but not of 64."""
    import torch
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=96,
        shared_expert_intermediate_size=32,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    out = tmp_path_factory.mktemp("w96") / "model"
    Qwen2MoeForCausalLM(cfg).save_pretrained(out)
    build_tokenizer(out)
    return out


def test_pick_group_takes_the_largest_that_divides_and_checks_an_explicit_one():
    assert pick_group((256, 128), None) == 128
    assert pick_group((192, 128), None) == 64
    assert pick_group((64, 96), None) == 32
    assert pick_group((256, 128), 64) == 64  # an explicit group wins
    with pytest.raises(FateEdgeError, match="--group 64 does not divide the expert dimensions 64x96; use --group 32"):
        pick_group((64, 96), 64)
    with pytest.raises(FateEdgeError, match="not multiples of 32"):
        pick_group((32, 16), None)


@pytest.mark.slow
def test_run_on_a_width_96_model_converts_with_group_32_and_says_so(width96, capsys):
    assert (
        main(["run", "--model", str(width96), "--memory-budget", "2MB", "--max-tokens", "2", "--ignore-eos", "a"]) == 0
    )
    assert "quantization group 32" in capsys.readouterr().err


def test_convert_refuses_when_the_disk_is_too_small(monkeypatch, tmp_path, bundled_dir, capsys):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    assert main(["convert", str(bundled_dir), str(tmp_path / "s"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and str(tmp_path) in err and "needs about" in err
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("how", ["oserror", "safetensors"])
def test_disk_full_while_writing_is_one_error_naming_dir_and_bytes(how, monkeypatch, tmp_path, bundled_dir, capsys):
    import fate_edge.format.convert as conv

    def full(*a, **kw):
        if how == "oserror":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        from safetensors import SafetensorError

        raise SafetensorError(
            "Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
            '"No space left on device" }) (os error 28)'
        )

    monkeypatch.setattr(conv, "save_streaming", full)  # the resident weights are written first: float ...
    monkeypatch.setattr("fate_edge.format.resident_writer.save_streaming", full)  # ... or quantized (the default)
    assert main(["convert", str(bundled_dir), str(tmp_path / "s"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"{tmp_path}: no space left" in err and "needs about" in err and " MB" in err
    assert list(tmp_path.iterdir()) == []  # the partial directory is gone


def test_every_store_file_has_one_mode_from_the_umask(store_dir):
    mask = os.umask(0o022)
    os.umask(mask)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in store_dir.iterdir() if f.is_file()}
    assert "resident.safetensors" in modes and set(modes.values()) == {0o666 & ~mask}, modes


@pytest.mark.parametrize(
    "damage,field",
    [
        (lambda d: [], "JSON list"),
        (lambda d: d["experts"]["4"][3].pop("crc32") and d, "experts.4[3].crc32 is missing"),
        (lambda d: d.update(precisions="x") or d, "store.precisions"),
        (lambda d: d["precisions"]["4"].pop("group_size") and d, "precisions.4.group_size"),
        (lambda d: d["experts"]["2"][0].update(offset="0") or d, "experts.2[0].offset is '0'"),
        (lambda d: d["experts"]["2"][0].update(offset=-4096) or d, "experts.2[0] names a place"),
        (lambda d: d["experts"]["4"][0].update(expert=10**6) or d, "experts.4[0] names a place or an expert"),
        (lambda d: d.update(num_experts=2**40) or d, "store.num_experts is 1099511627776"),
    ],
)
def test_store_json_of_the_wrong_shape_names_the_field(damage, field, tmp_path, store_dir):
    copy = shutil.copytree(store_dir, tmp_path / "s")
    index = json.loads((copy / "store.json").read_text())
    (copy / "store.json").write_text(json.dumps(damage(index)))
    with pytest.raises(ModelFormatError, match="re-run fate-edge convert") as info:
        ExpertStore(copy)
    assert field in str(info.value)


@pytest.mark.parametrize("file", ["/etc/passwd", "../../etc/passwd", "sub/experts-4.bin", "..", "experts-4.bin/"])
def test_a_store_index_cannot_name_a_blob_file_outside_the_store(file, tmp_path, store_dir, monkeypatch):
    copy = shutil.copytree(store_dir, tmp_path / "s")
    index = json.loads((copy / "store.json").read_text())
    index["precisions"]["4"]["file"] = file
    (copy / "store.json").write_text(json.dumps(index))
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **kw: opened.append(str(path)) or real_open(path, *a, **kw))
    with pytest.raises(ModelFormatError, match="not a blob file name inside the store"):
        ExpertStore(copy)
    assert not any("passwd" in p for p in opened)


def test_a_fifo_in_place_of_a_blob_file_is_refused_without_blocking(tmp_path, store_dir):
    copy = shutil.copytree(store_dir, tmp_path / "s")
    (copy / "experts-4.bin").unlink()
    os.mkfifo(copy / "experts-4.bin")
    with pytest.raises(ModelFormatError, match="not a regular file"):
        ExpertStore(copy)


def test_store_without_store_json_is_named_not_taken_for_a_checkpoint(tmp_path, store_dir, capsys):
    copy = shutil.copytree(store_dir, tmp_path / "s")
    (copy / "store.json").unlink()
    assert main(["run", "--model", str(copy), "--memory-budget", "4MB", "hi"]) == 2
    err = capsys.readouterr().err
    assert "store.json is missing" in err and "experts-4.bin" in err and "no routed experts" not in err
