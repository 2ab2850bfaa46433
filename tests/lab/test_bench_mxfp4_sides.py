"""``fate-edge bench-llamacpp`` on gpt-oss as published: a checkpoint with MXFP4 experts gets the ``mxfp4`` sides
(fate-edge's default store, its blocks kept, beside llama.cpp's converter's GGUF, its blocks kept too); the mxfp4 GGUF
type is refused for a checkpoint without them; the other checkpoints keep their sides."""

from __future__ import annotations

import json

import pytest

from fate_edge.errors import FateEdgeError
from fate_edge_lab.bench import gguf
from fate_edge_lab.bench import sidebyside as sbs
from fate_edge_lab.bench.llamacpp_cli import SIDE_NAMES, build_parser, main

MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}


def _checkpoint(tmp_path, name: str, **extra) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt_oss", "torch_dtype": "bfloat16", **extra}))
    return str(d)


def test_a_checkpoint_with_mxfp4_experts_gets_the_mxfp4_sides(tmp_path):
    published = _checkpoint(tmp_path, "published", quantization_config=MXFP4_CONFIG)
    float_layout = _checkpoint(tmp_path, "float")
    picked = sbs.pick_side_set("auto", published)
    assert picked is sbs.SIDE_SETS["mxfp4"] and picked.gguf_types == ("mxfp4",)
    assert sbs.pick_side_set("auto", float_layout) is sbs.SIDE_SETS["real"]  # bf16, no MXFP4: as before
    assert {s.precision for s in picked.resident + picked.limited} == {"mxfp4"}
    for ours, theirs in picked.pairs:  # each fate-edge side against a llama.cpp side with MXFP4 experts kept
        kinds = {s.name: s for s in picked.resident + picked.limited}
        assert kinds[ours].kind == "fate-edge" and kinds[theirs].kind == "llama.cpp"
        assert kinds[ours].mode == kinds[theirs].mode
    part = sbs.only_sides(picked, ["fate-edge mxfp4", "llama.cpp mxfp4"])
    assert part.pairs == [("fate-edge mxfp4", "llama.cpp mxfp4")] and part.gguf_types == ("mxfp4",)
    ours = [s for s in picked.resident + picked.limited if s.kind == "fate-edge"]
    assert {s.store for s in ours} == {sbs.PUBLISHED}  # the rest as published, beside llama.cpp's bf16 rest
    assert sbs.PUBLISHED not in {s.store for s in sbs.SIDE_SETS["real"].resident + sbs.SIDE_SETS["real"].limited}
    assert sbs.only_sides(picked, ["fate-edge mxfp4"]).gguf_types == ()  # no GGUF to build
    with pytest.raises(ValueError, match=r"^--sides mxfp4: .*float has no MXFP4 experts"):
        sbs.pick_side_set("mxfp4", float_layout)
    assert {"llama.cpp mxfp4", "fate-edge mxfp4, expert budget"} <= set(SIDE_NAMES)
    assert build_parser().parse_args(["--sides", "mxfp4", "--model", published]).sides == "mxfp4"


def test_cli_names_the_wrong_side_set_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--model", _checkpoint(tmp_path, "float"), "--sides", "mxfp4"])
    assert "argument --sides: --sides mxfp4:" in capsys.readouterr().err


def test_the_mxfp4_gguf_is_llama_cpps_converter_keeping_the_blocks(tmp_path, monkeypatch):
    assert gguf.OUTTYPE["mxfp4"] == "bf16" and "mxfp4" in gguf.CONVERTED  # experts kept, the rest bf16
    assert gguf.gguf_path(tmp_path, "mxfp4").name == "model-mxfp4.gguf"
    assert "mxfp4" not in gguf.DEFAULT_TYPES  # asked for by name: other checkpoints have no MXFP4 experts
    monkeypatch.setattr(gguf, "llama_cpp_missing", lambda: None)
    monkeypatch.setattr(gguf, "peers_cache", lambda: tmp_path / "peers")
    monkeypatch.setattr(gguf, "converter_dir", lambda extract=True: tmp_path)
    with pytest.raises(FateEdgeError, match=r"GGUF type mxfp4: .* has no MXFP4 experts"):
        gguf.ensure_ggufs(_checkpoint(tmp_path, "float"), ("mxfp4",))
