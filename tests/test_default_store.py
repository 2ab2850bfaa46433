"""The store convert writes with no options is lean: the int4 experts the default policy reads, resident linears and
the embedding table quantized, nothing else; the bf16 copy and float resident weights only when asked. A GGUF's
quantized resident tensors keep their width. The converted-store cache keys on what a store holds."""

from __future__ import annotations

import json

import pytest
from _gguf_writer import write_gguf
from _tiny_moe import build_wide_moe

from fate_edge import GenerateConfig
from fate_edge.apps.cli import main as cli_main
from fate_edge.errors import FateEdgeError
from fate_edge.format.checkpoint import CheckpointReader
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.format.converted_stores import ensure_store
from fate_edge.format.gguf_convert import convert_gguf
from fate_edge.format.prequantized import stored_bits
from fate_edge.format.store import STORE_FILE, ExpertStore
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig

# A few greedy tokens show a store runs (prefill, then decode through the experts); with no max_tokens the tiny model
# never says EOS and fills the engine's whole room (~1,270 tokens) for the same assertion.
FEW = GenerateConfig(max_tokens=8)


def _size(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_a_store_converted_with_no_options_holds_what_the_default_policy_reads(bundled_dir, tmp_path):
    lean = convert(bundled_dir, tmp_path / "lean", progress=False)
    assert sorted(ExpertStore(lean).precisions) == [4]
    assert stored_bits(CheckpointReader(lean)) == (4, 8)
    full = convert(bundled_dir, tmp_path / "full", ConvertOptions.full(), progress=False)
    assert sorted(ExpertStore(full).precisions) == [4, 16]
    assert stored_bits(CheckpointReader(full)) == (None, None)
    assert _size(lean) < 0.6 * _size(full)
    with Engine(EngineConfig(lean, "8MB", dtype="float32")) as engine:  # the default policy runs on it
        assert engine.complete("def f():", FEW).completion_tokens > 0
    with pytest.raises(FateEdgeError, match="needs bf16 experts.*--keep-bf16"):
        Engine(EngineConfig(lean, "8MB", policy="load-on-demand", dtype="float32"))


def test_convert_on_the_command_line_keeps_bf16_and_float_weights_only_when_asked(bundled_dir, tmp_path):
    assert cli_main(["convert", str(bundled_dir), str(tmp_path / "a"), "--quiet"]) == 0
    index = json.loads((tmp_path / "a" / STORE_FILE).read_text())
    assert list(index["precisions"]) == ["4"] and (index["resident_bits"], index["embedding_bits"]) == (4, 8)
    argv = ["convert", str(bundled_dir), str(tmp_path / "b"), "--quiet", "--keep-bf16", "--resident-bits", "none"]
    assert cli_main([*argv, "--embedding-bits", "8", "--head-bits", "8"]) == 0
    b = tmp_path / "b"
    assert sorted(ExpertStore(b).precisions) == [4, 16]
    reader = CheckpointReader(b)
    assert "lm_head.int8" in reader and "model.embed_tokens.int8" in reader
    assert "model.layers.0.self_attn.o_proj.weight" in reader  # the other linears as in the checkpoint


def test_the_cached_store_is_lean_and_keyed_by_what_it_holds(bundled_dir):
    lean = ensure_store(bundled_dir, progress=False)
    baselines = ensure_store(bundled_dir, progress=False, baselines=True)
    assert lean != baselines  # a store cached before the lean default (bf16 + float resident) is not taken for it
    assert sorted(ExpertStore(lean).precisions) == [4] and stored_bits(CheckpointReader(lean)) == (4, 8)
    assert sorted(ExpertStore(baselines).precisions) == [4, 16]
    assert stored_bits(CheckpointReader(baselines)) == (None, None)
    assert ensure_store(bundled_dir, progress=False) == lean  # made once


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    d = tmp_path_factory.mktemp("wide")
    model = build_wide_moe(d / "model", 256)
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return d, model


def test_gguf_resident_tensors_keep_their_own_width(wide):
    d, model = wide
    q8 = convert_gguf(write_gguf(model, d / "q8.gguf", "Q4_0", "Q8_0"), d / "q8", progress=False)
    assert stored_bits(CheckpointReader(q8)) == (8, 8)  # q8_0 tensors: int8, not the default int4
    q4 = convert_gguf(write_gguf(model, d / "q4.gguf", "Q4_0", "Q4_0", "Q8_0"), d / "q4", progress=False)
    reader = CheckpointReader(q4)
    assert "lm_head.int8" in reader  # the output matrix was q8_0
    assert any(k.endswith((".nint4", ".int4")) and "layers" in k for k in reader.keys())  # q4_0 attention: int4
    f32 = convert_gguf(write_gguf(model, d / "f32.gguf", "Q4_0", "F32"), d / "f32", progress=False)
    assert stored_bits(CheckpointReader(f32)) == (4, 8)  # float tensors take the defaults
    assert sorted(ExpertStore(f32).precisions) == [4]


def test_a_table_tied_to_the_head_takes_the_heads_precision(tmp_path):
    """The head multiplies by a tied table every token (it is held whole, unlike a table read by row): int4 with the
    other linears by default, int8 with --head-bits 8; the model runs on either."""
    model = build_wide_moe(tmp_path / "tied", 128, tie=True)
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    lean = convert(model, tmp_path / "lean", progress=False)
    assert stored_bits(CheckpointReader(lean)) == (4, 4)
    head8 = convert(model, tmp_path / "head8", ConvertOptions(head_bits=8), progress=False)
    assert stored_bits(CheckpointReader(head8)) == (4, 8)
    for store in (lean, head8):
        with Engine(EngineConfig(store, "4MB", dtype="float32")) as engine:
            assert engine.complete([1, 2, 3], FEW).completion_tokens > 0


def test_a_cached_store_from_before_the_block_order_record_is_converted_again(bundled_dir, tmp_path):
    """Stores cached before fate-edge recorded torch's int4 block order are refused at open; the store cache must
    convert its own stale copy again (once) rather than fail every run of a user who upgraded."""
    import shutil

    from safetensors.torch import load_file, save_file

    from fate_edge.format.store_age import RESIDENT_FILE, predates_block_order

    src = shutil.copytree(bundled_dir, tmp_path / "tiny")  # its own cache key: the shared cached store stays as it is
    store = ensure_store(src, progress=False)
    index = json.loads((store / STORE_FILE).read_text())
    planted = 0
    for p in index["precisions"].values():  # as an older fate-edge wrote them: no block order
        planted += p.pop("int4_block_rows", None) is not None
    (store / STORE_FILE).write_text(json.dumps(index))
    tensors = load_file(store / RESIDENT_FILE)
    old = {k: v for k, v in tensors.items() if not k.endswith(".int4_block_rows")}
    planted += len(tensors) - len(old)
    save_file(old, store / RESIDENT_FILE, metadata={"format": "pt"})
    assert planted and predates_block_order(store)
    with pytest.raises(FateEdgeError, match="block order"):
        Engine.load(store, memory_budget="2MB", device="cpu").close()
    assert ensure_store(src, progress=False) == store and not predates_block_order(store)
    with Engine.load(src, memory_budget="2MB", device="cpu", dtype="float32") as eng:
        assert eng.generate_text("def main():", FEW)[0]
