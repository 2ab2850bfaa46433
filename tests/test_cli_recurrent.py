"""The CLI on the recurrent architectures: ``fate-edge run`` on a tiny random LFM2-MoE, Qwen3-Next and Qwen3.5-MoE
checkpoint (the bundled model's tokenizer beside it) writes transformers' own greedy continuation, token for token
(experts resident and unquantized: the default expert store quantizes them to int4)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from _tiny_recurrent import CONFIGS, build_tiny  # noqa: E402

from fate_edge.apps.cli import main  # noqa: E402

PROMPT = "def fibonacci(n):"
NEW_TOKENS = 12


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_run_writes_transformers_greedy_continuation(arch: str, tmp_path: Path, capsys):
    hf = build_tiny(arch, tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0
        )
    want = tok.decode(out[0, ids.shape[1] :])
    args = ["run", "--model", str(tmp_path), "--experts", "memory", "--dtype", "float32", "--temperature", "0"]
    assert main([*args, "--max-tokens", str(NEW_TOKENS), "--ignore-eos", PROMPT]) == 0
    got, err = capsys.readouterr()
    assert f"{NEW_TOKENS} generated" in err
    assert got.rstrip("\n") == want
