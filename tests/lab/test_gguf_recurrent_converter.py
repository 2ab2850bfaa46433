"""llama.cpp's own converter (convert_hf_to_gguf.py from the llama-cpp-python sdist, an optional peer: skipped
with the reason without it) on tiny random LFM2-MoE, Qwen3-Next and Qwen3.5-MoE checkpoints: the f32 GGUF it writes
converts to the same store as the checkpoint itself (same expert bytes, same tokenizer ids, bit-equal logits),
so every rewrite the converter makes of these architectures (LFM2's squeezed convolution and renamed final norm;
Qwen3-Next's regrouped in_proj_qkvz, -exp(A_log) and norms + 1; Qwen3.5's tiled value heads) is undone exactly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fate_edge import Tokenizer
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.format.gguf_convert import convert_gguf
from fate_edge.runtime.loader import load_model
from fate_edge_lab.bench import gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _tiny_recurrent import _BASE, build_tiny  # noqa: E402

TEXT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)"


@pytest.fixture(scope="module")
def converter():
    try:
        return gguf.converter_dir()
    except gguf.PeerUnavailableError as exc:
        pytest.skip(str(exc))


def _logits(store: Path, ids: list[int]) -> torch.Tensor:
    model = load_model(store, torch.float32, bits=16)
    try:
        cache = model.new_cache()
        x = torch.tensor([ids])
        return torch.cat([model(x[:, :-2], cache), model(x[:, -2:-1], cache), model(x[:, -1:], cache)], dim=1)
    finally:
        model.experts.close()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["lfm2_moe", "qwen3_next", "qwen3_5_moe_text"])
def test_llama_cpp_gguf_converts_to_the_checkpoints_own_store(arch: str, converter, tmp_path: Path, monkeypatch):
    model = tmp_path / "hf"
    model.mkdir()
    if arch == "lfm2_moe":  # llama.cpp's LFM2-MoE has no separate lm_head (the published model ties it)
        monkeypatch.setitem(_BASE, "tie_word_embeddings", True)
    build_tiny(arch, model)
    path = tmp_path / "model-f32.gguf"
    cmd = gguf.convert_command(model, "f32", path, converter)  # --no-mtp for Qwen3-Next's family: gguf.mtp_flags
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    opts = ConvertOptions.full(bits=8, keep_bf16=True)
    ours = convert_gguf(path, tmp_path / "from-gguf", opts, progress=False)
    ref = convert(model, tmp_path / "from-safetensors", opts, progress=False)
    for f in ("experts-8.bin", "experts-16.bin"):
        assert (ours / f).read_bytes() == (ref / f).read_bytes(), f
    ids = Tokenizer(ref).encode(TEXT)
    assert Tokenizer(ours).encode(TEXT) == ids
    assert torch.equal(_logits(ours, ids), _logits(ref, ids))
