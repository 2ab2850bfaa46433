"""GGUF input without llama.cpp: the ``gguf`` package writes GGUFs of the bundled checkpoint (q4_0, q8_0 experts;
f32 resident), fate-edge converts them, and the store equals one converted from the same weights quantized the same
way (ggml's rounding): the same expert bytes, the same logits. q4_K (gguf-py cannot write it): test_gguf_q4k.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _gguf_reference import reference_store
from _gguf_writer import write_gguf

from fate_edge import Tokenizer
from fate_edge.errors import ModelFormatError, UnsupportedArchitectureError
from fate_edge.format.convert import ConvertOptions
from fate_edge.format.gguf_config import hf_config
from fate_edge.format.gguf_convert import convert_gguf
from fate_edge.format.gguf_reader import GGUFFile
from fate_edge.format.gguf_tokenizer import tokenizer_files
from fate_edge.format.store import ExpertStore
from fate_edge.runtime.loader import load_model

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory, bundled_dir):
    d = tmp_path_factory.mktemp("gguf")
    return {kind: write_gguf(bundled_dir, d / f"tiny-{kind.lower()}.gguf", kind, "F32") for kind in ("Q4_0", "Q8_0")}


def _logits(store, bits: int) -> torch.Tensor:
    model = load_model(store, torch.float32, bits=bits)
    ids = Tokenizer(store).encode(PROMPT)
    out = model.forward(torch.tensor([ids]), model.new_cache())
    model.experts.close()
    return out[0]


@pytest.mark.parametrize("kind,bits", [("Q4_0", 4), ("Q8_0", 8)])
def test_gguf_store_equals_the_store_of_the_same_weights_quantized_the_same_way(
    tmp_path, ggufs, bundled_dir, kind, bits
):
    ours = convert_gguf(
        ggufs[kind], tmp_path / "from-gguf", ConvertOptions.full(bits=None, keep_bf16=False), progress=False
    )
    ref = reference_store(bundled_dir, tmp_path / "from-safetensors", kind.lower())
    assert ExpertStore(ours).bits_available == [bits]
    assert (ours / f"experts-{bits}.bin").read_bytes() == (ref / f"experts-{bits}.bin").read_bytes()
    a, b = _logits(ours, bits), _logits(ref, bits)
    assert torch.equal(a, b)


def test_gguf_config_and_tokenizer_match_the_checkpoint(tmp_path, ggufs, bundled_dir):
    store = convert_gguf(ggufs["Q4_0"], tmp_path / "s", progress=False)
    cfg = json.loads((store / "config.json").read_text())
    src = json.loads((bundled_dir / "config.json").read_text())
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "vocab_size",
    ):
        assert cfg[key] == src[key], key
    text = (bundled_dir / "README.md").read_text()
    ours, theirs = Tokenizer(store), Tokenizer(bundled_dir)
    assert ours.encode(text) == theirs.encode(text)
    assert ours.eos_token_ids == theirs.eos_token_ids
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs) == theirs.apply_chat_template(msgs)


def _left_behind(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith((".out", "out")))


@pytest.mark.parametrize("cut", [100, 4000, -1000])
def test_truncated_gguf_is_named_and_nothing_is_left(tmp_path, ggufs, cut):
    data = ggufs["Q4_0"].read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:cut])
    with pytest.raises(ModelFormatError) as err:
        convert_gguf(bad, tmp_path / "out", progress=False)
    msg = str(err.value)
    assert "\n" not in msg and str(bad) in msg and "re-download" in msg
    if cut < 0:
        assert "truncated, tensor 'blk.7." in msg  # the last tensors are the ones cut
    assert _left_behind(tmp_path) == []


def _rewrite(src, dst, arch: str | None = None, retype: tuple[str, int] | None = None):
    """``src`` with general.architecture overwritten by ``arch`` (same length) or tensor ``retype[0]``'s type id
    patched to ``retype[1]``."""
    from gguf import GGUFReader

    data = bytearray(src.read_bytes())
    r = GGUFReader(str(src))

    def at(part) -> int:  # file offset of a part the reader parsed
        return part.__array_interface__["data"][0] - r.data.__array_interface__["data"][0]

    if arch is not None:
        f = r.fields["general.architecture"]
        part = f.parts[f.data[0]]
        data[at(part) : at(part) + len(part)] = arch.encode().ljust(len(part), b"x")[: len(part)]
    if retype is not None:
        part = next(t for t in r.tensors if t.name == retype[0]).field.parts[4]
        data[at(part) : at(part) + 4] = retype[1].to_bytes(4, "little")
    dst.write_bytes(bytes(data))
    return dst


def test_unknown_architecture_names_the_key(tmp_path, ggufs):
    bad = _rewrite(ggufs["Q4_0"], tmp_path / "arch.gguf", arch="gemma2xx")
    with pytest.raises(UnsupportedArchitectureError) as err:
        convert_gguf(bad, tmp_path / "out", progress=False)
    assert "general.architecture" in str(err.value) and "\n" not in str(err.value)
    assert _left_behind(tmp_path) == []


def test_unknown_quant_type_names_the_tensor(tmp_path, ggufs):
    bad = _rewrite(ggufs["Q4_0"], tmp_path / "qtype.gguf", retype=("blk.3.ffn_up_exps.weight", 77))
    with pytest.raises(ModelFormatError) as err:
        convert_gguf(bad, tmp_path / "out", progress=False)
    assert "blk.3.ffn_up_exps.weight" in str(err.value) and "77" in str(err.value)
    assert _left_behind(tmp_path) == []


def test_cli_converts_a_gguf(tmp_path, ggufs):
    from fate_edge.apps.cli import main

    assert main(["convert", str(ggufs["Q8_0"]), str(tmp_path / "store"), "--quiet", "--no-bf16"]) == 0
    assert ExpertStore(tmp_path / "store").bits_available == [8]


def test_engine_load_takes_a_gguf_path(tmp_path, ggufs, monkeypatch):
    """``Engine.load`` on the .gguf itself: converted once into the store cache, then the same completion as an
    engine on the store ``fate-edge convert`` writes from the file."""
    from fate_edge import Engine, GenerateConfig
    from fate_edge.runtime.engine_config import EngineConfig

    monkeypatch.setenv("FATE_EDGE_CACHE", str(tmp_path / "cache"))
    cfg = GenerateConfig(max_tokens=12, ignore_eos=True)
    engine = Engine.load(ggufs["Q4_0"], "64MB", "fate-edge")
    text, last = engine.generate_text(PROMPT, cfg)
    assert engine.policy.bits == 4 and last.generation_tokens == 12
    assert str(engine.store.path).startswith(str(tmp_path / "cache"))
    engine.close()
    again = Engine.load(ggufs["Q4_0"], "64MB", "fate-edge")  # from the cache: nothing converted twice
    assert again.store.path == engine.store.path
    again.close()
    store = convert_gguf(ggufs["Q4_0"], tmp_path / "store", progress=False)
    direct = Engine(EngineConfig(store, "64MB", "fate-edge"))
    assert direct.generate_text(PROMPT, cfg)[0] == text
    direct.close()


def test_presets_run_on_the_int8_store_of_a_q8_0_gguf(tmp_path, ggufs, monkeypatch):
    """A q8_0 GGUF converts to its own int8 codes (no int4 copy): every preset that reads the store's quantized
    copy streams int8, load-on-demand reads bf16, and load-on-demand-int4 refuses in one line naming what the store
    holds. The oracle needs a recorded trace and is not run here."""
    from fate_edge import Engine, GenerateConfig
    from fate_edge.errors import FateEdgeError
    from fate_edge.format.converted_stores import ensure_store
    from fate_edge.runtime.policy import PRESETS

    monkeypatch.setenv("FATE_EDGE_CACHE", str(tmp_path / "cache"))
    cfg = GenerateConfig(max_tokens=8, ignore_eos=True)
    texts = {}
    # the baselines' store: the bf16 copy load-on-demand reads and Fate's int2 copy, asked for (the default is lean)
    store = ensure_store(ggufs["Q8_0"], cold_bits=2, progress=False, baselines=True)
    for name in sorted(set(PRESETS) - {"oracle", "load-on-demand-int4"}):
        engine = Engine.load(store, "64MB", name)
        assert ExpertStore(engine.store.path).bits_available == [2, 8, 16]
        assert engine.policy.bits == (16 if name == "load-on-demand" else 8), name
        texts[name], last = engine.generate_text(PROMPT, cfg)
        assert last.generation_tokens == 8, name
        engine.close()
    # int8 greedy decoding by any caching policy is the same computation: only the expert reads differ
    assert len({t for n, t in texts.items() if n != "load-on-demand"}) == 1, texts
    with pytest.raises(FateEdgeError, match=r"needs int4 experts but .* holds \[2, 8, 16\]"):
        Engine.load(store, "64MB", "load-on-demand-int4")


def test_our_header_parse_equals_the_gguf_packages(ggufs):
    """format/gguf_header.py reads the same metadata and tensor table as llama.cpp's own Python reader."""
    from gguf import GGUFReader

    from fate_edge.format.gguf_header import read_header

    for path in ggufs.values():
        ours, theirs = read_header(path), GGUFReader(str(path))
        assert ours.fields == {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
        assert [(t.name, t.dims, t.qtype, ours.data_start + t.offset) for t in ours.tensors] == [
            (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.data_offset)) for t in theirs.tensors
        ]


def test_q4_0_and_q8_0_tensors_dequantize_as_the_gguf_package_does(ggufs):
    """The reader's torch path for q4_0 / q8_0 (through the exact block mapping) gives the package's floats."""
    from gguf import quants

    from fate_edge.format.gguf_reader import GGUFFile

    checked = set()
    for path in ggufs.values():
        f = GGUFFile(path)
        for name, t in f.tensors.items():
            if t.type_name in ("Q4_0", "Q8_0"):
                want = quants.dequantize(f.read_bytes(name), t.qtype).reshape(t.shape)
                assert np.array_equal(f.dequantize(name).numpy(), want), name
                checked.add(t.type_name)
        f.close()
    assert checked == {"Q4_0", "Q8_0"}


@pytest.mark.parametrize(
    "key,value,read",
    [
        ("{arch}.rope.freq_base", "fast", lambda g: hf_config(g, "float32")),
        ("tokenizer.ggml.merges", 7, tokenizer_files),
    ],
)
def test_a_metadata_value_of_the_wrong_kind_names_its_key(ggufs, key, value, read):
    g = GGUFFile(ggufs["Q4_0"])
    key = key.format(arch=g.architecture)
    g.fields[key] = value
    with pytest.raises(ModelFormatError) as err:
        read(g)
    msg = str(err.value)
    assert f"metadata '{key}' is {value}, a value of the wrong kind" in msg and "\n" not in msg
    assert "re-convert it with llama.cpp" in msg
