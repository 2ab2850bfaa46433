"""The llama.cpp peer's parts that need no llama.cpp: GGUF cache keys and paths, the converter's command line
and pre-tokenizer fallback, finding the sdist, timing, and the skip messages. The conversion itself runs only
where llama-cpp-python and its sdist are installed."""

from __future__ import annotations

import importlib.util
import shutil
import sys
import tarfile

import pytest

from fate_edge import bundled_model_dir
from fate_edge_lab.bench import gguf
from fate_edge_lab.bench.llamacpp import time_tokens
from fate_edge_lab.bench.threads import competitor_command, run_child, start_competitors, stop_competitors


@pytest.fixture
def model_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("FATE_EDGE_PEERS_CACHE", str(tmp_path / "cache"))
    dst = tmp_path / "tiny-moe"
    shutil.copytree(bundled_model_dir(), dst, ignore=shutil.ignore_patterns("predictors"))
    return dst


def test_gguf_paths_live_in_the_peers_cache_keyed_by_fingerprint(model_copy, tmp_path):
    p = gguf.gguf_path(model_copy, "q4_0")
    assert p.parent.parent == tmp_path / "cache" / "gguf" and p.name == "model-q4_0.gguf"
    assert p == gguf.gguf_path(model_copy, "q4_0")  # stable
    assert p.parent == gguf.gguf_path(model_copy, "f32").parent  # one directory per checkpoint
    st = next(model_copy.glob("*.safetensors"))
    st.write_bytes(st.read_bytes() + b"\0")  # the weights changed: a new key
    assert gguf.gguf_path(model_copy, "q4_0").parent != p.parent


def test_changed_config_gets_a_new_key(model_copy):
    before = gguf.gguf_dir(model_copy)
    cfg = model_copy / "config.json"
    cfg.write_text(cfg.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    assert gguf.gguf_dir(model_copy) != before


def test_unknown_gguf_type_is_refused_with_the_choices(model_copy):
    with pytest.raises(gguf.FateEdgeError, match="f32, bf16, q4_0"):
        gguf.gguf_path(model_copy, "q8_0")


def test_convert_command_runs_this_modules_wrapper(tmp_path):
    cmd = gguf.convert_command("/m", "bf16", tmp_path / "o.gguf", "/ll")
    assert cmd[:3] == [sys.executable, "-m", "fate_edge_lab.bench.gguf"]
    assert cmd[3:] == ["--convert", "/ll", "/m", "--outtype", "bf16", "--outfile", str(tmp_path / "o.gguf")]


class _FakeTextModel:
    """Stands in for the converter's TextModel: knows one tokenizer hash, refuses the rest as it does."""

    def get_vocab_base_pre(self, tokenizer) -> str:
        if tokenizer == "known":
            return "llama-bpe"
        raise NotImplementedError("BPE pre-tokenizer was not recognized - update get_vocab_base_pre()")


def test_unknown_pre_tokenizer_hash_maps_to_gpt2_and_known_ones_are_kept():
    cls = type("M", (_FakeTextModel,), {})
    with pytest.raises(NotImplementedError):
        cls().get_vocab_base_pre("ours")
    gguf.patch_pre_tokenizer(cls)
    gguf.patch_pre_tokenizer(cls)  # idempotent: no double wrapping
    assert cls().get_vocab_base_pre("ours") == "gpt-2"
    assert cls().get_vocab_base_pre("known") == "llama-bpe"


def test_converter_is_unpacked_from_the_sdist_without_the_rest(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("FATE_EDGE_PEERS_CACHE", str(cache))
    src = tmp_path / "pkg"
    files = [
        "vendor/llama.cpp/convert_hf_to_gguf.py",
        "vendor/llama.cpp/conversion/base.py",
        "vendor/llama.cpp/gguf-py/gguf/__init__.py",
        "vendor/llama.cpp/src/llama.cpp",
        "llama_cpp/__init__.py",
    ]
    for f in files:
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        (src / f).write_text("# stub\n")
    sdist = tmp_path / "llama_cpp_python-9.9.9.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(src, arcname="llama_cpp_python-9.9.9")
    monkeypatch.setenv("FATE_EDGE_LLAMACPP_SDIST", str(sdist))
    d = gguf.converter_dir()
    assert d == cache / "src" / "llama_cpp_python-9.9.9" / "vendor" / "llama.cpp"
    assert (d / "convert_hf_to_gguf.py").exists() and (d / "conversion" / "base.py").exists()
    assert not (d / "src").exists() and not (d.parent.parent / "llama_cpp").exists()  # only the converter


def test_missing_sdist_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("FATE_EDGE_PEERS_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("FATE_EDGE_LLAMACPP_SDIST", str(tmp_path / "absent.tar.gz"))
    monkeypatch.setattr(gguf, "sdist_candidates", lambda: [tmp_path / "absent.tar.gz"])
    with pytest.raises(gguf.PeerUnavailableError, match="FATE_EDGE_LLAMACPP_SDIST"):
        gguf.converter_dir()


def test_missing_llama_cpp_python_skips_with_the_install_command(model_copy, monkeypatch):
    monkeypatch.setattr(gguf.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(gguf.PeerUnavailableError, match="pip install llama-cpp-python"):
        gguf.ensure_ggufs(model_copy)


def test_time_tokens_counts_prefill_and_decode():
    t = time_tokens(iter([5, 6, 7, 8, 9]), n_prompt=10, want=3)
    assert t["tokens"] == [5, 6, 7] and t["prefill_tps"] > 0 and t["decode_tps"] > 0
    assert time_tokens(iter([1]), 4, 3)["decode_tps"] is None


@pytest.mark.parametrize(
    "sig, says", [("SIGILL", "an instruction this CPU does not run"), ("SIGTERM", "signal SIGTERM")]
)
def test_a_child_ended_by_a_signal_is_reported_by_name(sig, says):
    """A llama.cpp child built for instructions this VM faults on died with 'exit -4: ' and nothing else."""
    cmd = [sys.executable, "-c", f"import os, signal; os.kill(os.getpid(), signal.{sig})"]
    error = run_child(cmd, timeout=60)["error"]
    assert sig in error and says in error


def test_competitors_are_bounded_and_killed():
    assert "while time.time() < t" in competitor_command(5)[-1]
    procs = start_competitors(2, 30)
    stop_competitors(procs)
    assert all(p.returncode is not None for p in procs)


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
@pytest.mark.slow
def test_gguf_of_the_bundled_model_tokenizes_and_decodes_like_fate_edge(one_thread):
    import torch

    from fate_edge import load_model, stream_from_model
    from fate_edge.corpus import heldout_source
    from fate_edge.runtime.generate import GenerateConfig
    from fate_edge.tokenizer import Tokenizer
    from fate_edge_lab.bench.llamacpp import llama_stream, open_llama, tokens_agree

    try:
        path = gguf.ensure_ggufs(bundled_model_dir(), ("f32",))["f32"]
    except gguf.PeerUnavailableError as exc:
        pytest.skip(str(exc))
    tok = Tokenizer(bundled_model_dir())
    text, _ = heldout_source(2000)
    ids = tok.encode(text)
    llm = open_llama(path, 256, 1, mmap=True)
    assert tokens_agree(llm, text, ids)["equal"]
    theirs = time_tokens(llama_stream(llm, ids[:64]), 64, 8)["tokens"]
    model = load_model(bundled_model_dir(), torch.float32)
    ours = [r.token for r in stream_from_model(model, tok, ids[:64], GenerateConfig(max_tokens=8, ignore_eos=True))]
    assert ours == theirs


def test_decode_reads_per_token_leave_out_the_prefills_reads(monkeypatch, capsys):
    """child_main's MB read per decoded token counts from the first token on: at real size the prefill reads
    the whole model once, which divided by 16 decode tokens would read as hundreds of MB per token."""
    import json

    from fate_edge_lab.bench import sidebyside

    disk = [0]

    def stream(spec):
        disk[0] += 5_000_000  # the prefill reads 5 MB, then the first token arrives
        yield 1
        for tok in range(2, 6):
            disk[0] += 2_000_000  # 2 MB per decoded token
            yield tok

    monkeypatch.setattr(sidebyside, "read_bytes", lambda: disk[0])
    monkeypatch.setattr(sidebyside, "_fate_edge_stream", stream)
    sidebyside.child_main(json.dumps({"kind": "fate-edge", "ids": [1, 2, 3], "decode_tokens": 4}))
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["tokens"] == [1, 2, 3, 4, 5]
    assert out["prefill_read_mb"] == 5.0 and out["decode_read_mb_per_token"] == 2.0


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_q4_0_direct_makes_its_folder(tmp_path):
    """The cache folder of a model seen for the first time does not exist yet (the converter failed to open it)."""
    try:
        gguf.converter_dir()
    except gguf.PeerUnavailableError as exc:
        pytest.skip(str(exc))
    out = tmp_path / "gguf" / "tiny-moe-0123" / "model-q4_0.gguf"
    assert gguf.q4_0_direct(bundled_model_dir(), out) == out and out.stat().st_size > 0
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # the mix is deleted
