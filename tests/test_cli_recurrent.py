"""The CLI on the recurrent architectures: ``fate-edge run`` on a tiny random LFM2-MoE, Qwen3-Next and Qwen3.5-MoE
checkpoint (the bundled model's tokenizer beside it) writes transformers' own greedy continuation, token for token
(experts resident and unquantized: the default expert store quantizes them to int4)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from fate_edge.apps.cli import main  # noqa: E402

ASSET = Path(__file__).resolve().parents[1] / "fate_edge" / "assets" / "tiny-moe"
PROMPT = "def fibonacci(n):"
NEW_TOKENS = 12

_BASE = dict(
    vocab_size=4096,  # the bundled tokenizer's
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=False,
    num_hidden_layers=2,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
)
_DELTA = dict(
    head_dim=16,
    shared_expert_intermediate_size=48,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    layer_types=["linear_attention", "full_attention"],
)
CONFIGS = {
    "lfm2_moe": (
        "Lfm2MoeConfig",
        dict(layer_types=["conv", "full_attention"], intermediate_size=96, num_dense_layers=1),
    ),
    "qwen3_next": ("Qwen3NextConfig", dict(_DELTA, intermediate_size=96)),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", _DELTA),
}


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_run_writes_transformers_greedy_continuation(arch: str, tmp_path: Path, capsys):
    cls, extra = CONFIGS[arch]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**{**_BASE, **extra})).eval()
    hf.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSET / name, tmp_path / name)
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
