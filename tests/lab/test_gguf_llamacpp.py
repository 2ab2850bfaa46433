"""GGUF input against llama.cpp itself (skipped without llama-cpp-python): GGUFs made by llama.cpp's own converter
and quantizer from the bundled checkpoint (``fate_edge_lab.bench.gguf``), converted by fate-edge; the tokenizer gives
llama.cpp's ids on held-out stdlib text, and the first-position logits match llama.cpp's on the same ids."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from fate_edge import Tokenizer
from fate_edge.corpus import heldout_source
from fate_edge.format.convert import ConvertOptions
from fate_edge.format.gguf_convert import convert_gguf
from fate_edge.runtime.loader import load_model
from fate_edge_lab.bench.gguf import ensure_ggufs, llama_cpp_missing
from fate_edge_lab.bench.llamacpp import llama_child

pytestmark = pytest.mark.skipif(llama_cpp_missing() is not None, reason="llama-cpp-python is not installed")

PROMPT = "import os\n\ndef main(argv):\n    for name in os.listdir(argv[1]):\n        print(name)\n"

_CHILD = """
import json, sys
import numpy as np
from llama_cpp import Llama
path, text_file, ids_file, out = sys.argv[1:5]
llm = Llama(model_path=path, n_ctx=512, n_threads=2, n_threads_batch=2, logits_all=True, verbose=False)
text = open(text_file, encoding="utf-8").read()
ids = json.load(open(ids_file))
toks = llm.tokenize(text.encode(), add_bos=False, special=False)
llm.eval(ids)
np.save(out + ".npy", np.array(llm.scores[: len(ids)], dtype=np.float32))
json.dump(toks, open(out + ".json", "w"))
"""


def llama_cpp_run(gguf, text: str, ids: list[int], tmp_path) -> tuple[np.ndarray, list[int]]:
    """llama.cpp's logits on ``ids`` and its ids for ``text``, in a fresh interpreter (its own OpenMP runtime)."""
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    (tmp_path / "ids.json").write_text(json.dumps(ids))
    out = tmp_path / "llama"
    subprocess.run(
        [
            sys.executable,
            "-c",
            llama_child(_CHILD),
            str(gguf),
            str(tmp_path / "text.txt"),
            str(tmp_path / "ids.json"),
            str(out),
        ],
        check=True,
        timeout=600,
    )
    return np.load(str(out) + ".npy"), json.loads((tmp_path.joinpath("llama.json")).read_text())


@pytest.fixture(scope="module")
def llama_ggufs(bundled_dir):
    return ensure_ggufs(bundled_dir, ("f32", "q4_0"))


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("kind,bits,floor", [("f32", 16, 0.9999), ("q4_0", 4, 0.999)])
def test_logits_and_ids_match_llama_cpp(tmp_path, llama_ggufs, kind, bits, floor):
    """f32: bf16 experts against llama.cpp's f32; q4_0: the blocks' own int4 codes against llama.cpp's q4_0."""
    store = convert_gguf(llama_ggufs[kind], tmp_path / "store", ConvertOptions.full(bits=None), progress=False)
    tok = Tokenizer(store)
    text, _ = heldout_source(20000)
    ids = tok.encode(PROMPT)
    theirs, their_ids = llama_cpp_run(llama_ggufs[kind], text, ids, tmp_path)
    assert tok.encode(text) == their_ids
    model = load_model(store, torch.float32, bits=bits)
    ours = model.forward(torch.tensor([ids]), model.new_cache())[0].float().numpy()
    model.experts.close()
    cos = [_cos(ours[i], theirs[i]) for i in range(len(ids))]
    assert cos[0] >= floor, cos
    assert min(cos) >= floor - 0.01, cos  # every position, a little looser: errors compound along the prompt
