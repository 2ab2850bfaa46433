"""fate-edge eval-quality (fate_edge_lab.bench.quality) on a tiny random MoE: structure and invariants (no quality
orderings: weights are random)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from fate_edge_lab.bench import quality


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A random qwen2_moe whose expert dims are multiples of 32 (group-quantizable) and of 16 (int4 kernel)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        mlp_only_layers=[2],
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny-eval")
    Qwen2MoeForCausalLM(cfg).save_pretrained(out)
    return out


@pytest.mark.slow
def test_evaluate_structure_and_invariants(tiny_dir):
    ids = torch.randint(0, 256, (512,), generator=torch.Generator().manual_seed(1))
    res = quality.evaluate(tiny_dir, ids, ids, seq_len=64, batch=4, log=lambda _: None)
    assert res["eval_tokens"] == 512 and res["calib_tokens"] == 512
    labels = ["int8", "int4", "int3", "int2", quality.TAIL_LABEL]
    got = [(r["experts"], r["method"]) for r in res["rows"]]
    assert got == [("bf16", "-")] + [(label, m) for m in ("rtn", "hqq") for label in labels]
    bf16 = res["rows"][0]
    assert bf16["agreement"] == 1.0  # a fresh load reproduces the reference run bit for bit
    for r in res["rows"]:
        assert math.isfinite(r["ppl"]) and r["ppl"] > 1 and abs(math.log(r["ppl"]) - r["nll"]) < 1e-9
        assert 0.0 <= r["agreement"] <= 1.0
    # Layer 2 is dense: the tail only names MoE layers, and never a whole layer.
    tail = res["tail"]
    assert set(tail["experts"]) == {"0", "1", "3"}
    assert all(len(v) < 8 for v in tail["experts"].values())
    assert abs(tail["calib_share"] - 0.30) <= 0.05
    assert tail["eval_share_bf16_routing"] == pytest.approx(tail["calib_share"])  # same tokens here
    for r in res["rows"]:
        if r["experts"] == quality.TAIL_LABEL:
            assert abs(r["tail_share"] - 0.30) <= 0.05
            assert 3.0 < r["bits_per_weight"] < 4.5 and 3.0 <= r["memory_bits_per_weight"] <= 4.5
    table = quality.render(res)
    assert "| bf16 | 16.00 |" in table and "| int4 + int2 tail |" in table


def test_choose_tail_hits_the_share_across_layers():
    gen = torch.Generator().manual_seed(0)
    counts = {layer: (torch.rand(16, generator=gen) ** 4 * 1000).round() for layer in range(8)}  # skewed
    for share in (0.1, 0.3, 0.5):
        tail = quality.choose_tail(counts, share)
        assert abs(quality.tail_share(counts, tail) - share) < 0.02
        for layer, experts in tail.items():  # the tail is the least-used experts of its layer
            rest = [e for e in range(16) if e not in experts]
            if experts:
                assert counts[layer][experts].max() <= counts[layer][rest].min()


def test_spec_for_falls_back_to_a_dividing_group():
    assert str(quality.spec_for(4, (192, 128))) == "int4-g64-asym"
    assert str(quality.spec_for(2, (192, 128))) == "int2-g32-asym"
    assert str(quality.spec_for(4, (64, 32))) == "int4-g32-asym"
    with pytest.raises(ValueError, match="multiples of 32"):
        quality.spec_for(4, (48, 16))


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory) -> Path:
    """A random qwen2_moe with a tokenizer (quantizable expert dims, as tiny_dir), so main() can run on text."""
    from _tiny_moe import VOCAB, build_tokenizer
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny-eval-tok")
    Qwen2MoeForCausalLM(cfg).save_pretrained(out)
    build_tokenizer(out)
    return out


def test_text_scores_any_model_on_its_own_heldout_text(tiny_with_tokenizer, tmp_path):
    from _tiny_moe import CORPUS

    from fate_edge import Tokenizer

    text = tmp_path / "heldout.txt"
    text.write_text("".join(CORPUS[:12]))
    out = tmp_path / "quality.json"
    assert (
        quality.main(
            [
                "--model",
                str(tiny_with_tokenizer),
                "--text",
                str(text),
                "--tokens",
                "4096",
                "--calib-tokens",
                "64",
                "--seq-len",
                "32",
                "--batch",
                "4",
                "--methods",
                "rtn",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())
    ids = quality.encode_texts(Tokenizer(tiny_with_tokenizer), [text.read_text()], 10**6)
    assert 4 * 32 < len(ids) - 64 < 4096  # the file, not the 4096-token budget, bounds what is scored
    assert res["calib_tokens"] == 64 and res["eval_tokens"] == (len(ids) - 64) // 32 * 32
    assert res["text"]["source"] == str(text) and res["text"]["tokens"] == len(ids)
    assert res["rows"][0]["experts"] == "bf16" and res["rows"][0]["agreement"] == 1.0
    assert [r["experts"] for r in res["rows"][1:]] == ["int8", "int4", "int3", "int2", quality.TAIL_LABEL]
    assert "held-out tokens of `heldout.txt`" in quality.render(res)
    short = tmp_path / "short.txt"
    short.write_text("def f(): pass\n")
    with pytest.raises(SystemExit, match="--seq-len"):
        quality.main(["--model", str(tiny_with_tokenizer), "--text", str(short), "--seq-len", "32", "--json", str(out)])
