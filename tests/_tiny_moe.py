"""Build a tiny random qwen2_moe checkpoint (with a byte-level BPE tokenizer) for tests.

Layer 2 is dense (``mlp_only_layers``) so code that walks MoE layers must skip it.
transformers is a test dependency; the runtime never imports it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 320
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nfor name in os.listdir('.'):\n    print(name)\n",
] * 20


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))


def _save(out: Path, model_class, cfg, seed: int = 0, random_norms: str | None = None) -> Path:
    """``model_class(cfg)`` drawn from ``seed``, saved to ``out`` with the test tokenizer. ``random_norms``: the name
    ending of the norm weights to draw in [0.5, 1.5] (transformers starts them all at 1, where a norm's weight would
    count for nothing)."""
    torch.manual_seed(seed)
    model = model_class(cfg)
    if random_norms is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(random_norms):
                    p.uniform_(0.5, 1.5)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    build_tokenizer(out)
    return out


# What the wide checkpoints share: two layers of two query heads over one key/value head, 128 positions
WIDE = dict(
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=128,
    bos_token_id=0,
    eos_token_id=0,
)


def build_tiny_moe(out: Path, seed: int = 0, top_k: int = 2, expert_dim: int = 16) -> Path:
    """``top_k``: experts per token (of 8). Above 2 the order experts are summed in changes the bits.
    ``expert_dim``: the experts' intermediate size (32 makes them quantizable: convert's groups are >= 32)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=8,
        num_experts_per_tok=top_k,
        moe_intermediate_size=expert_dim,
        shared_expert_intermediate_size=32,
        mlp_only_layers=[2],
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    # random norms, so the norm-variant predictor differs from the plain one
    return _save(out, Qwen2MoeForCausalLM, cfg, seed, random_norms="layernorm.weight")


def build_wide_moe(out: Path, width: int, vocab: int = VOCAB, tie: bool = False) -> Path:
    """A 2-layer Qwen2-MoE checkpoint (4 experts, top-2) whose hidden and expert width is ``width``: wide enough for
    the kernels and block formats that need whole groups (the native int4 kernel: 128; q4_K super-blocks: 256)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=256,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=width,
        shared_expert_intermediate_size=128,
        tie_word_embeddings=tie,
        **WIDE,
    )
    return _save(out, Qwen2MoeForCausalLM, cfg)


def build_wide_mixtral(out: Path, width: int, vocab: int = VOCAB) -> Path:
    """A 2-layer Mixtral checkpoint (4 experts, top-2, no shared expert, GQA) whose hidden and expert width is
    ``width``: the shape of :func:`build_wide_moe` without Qwen's shared expert."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=width,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=None,
        tie_word_embeddings=False,
        **WIDE,
    )
    return _save(out, MixtralForCausalLM, cfg)


def build_wide_qwen3(out: Path, width: int, vocab: int = VOCAB) -> Path:
    """A 2-layer Qwen3-MoE checkpoint (4 experts, top-2, no shared expert, per-head q/k norms with random weights,
    GQA with 64-wide heads) whose hidden and expert width is ``width``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=width,
        head_dim=64,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=width,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        **WIDE,
    )
    return _save(out, Qwen3MoeForCausalLM, cfg, random_norms="norm.weight")  # the q/k norms' weights count


def build_tiny_mla(out: Path) -> Path:
    """A tiny random DeepSeek-V2 checkpoint (MLA attention, 8 experts top-2, a shared expert, layer 0 dense), wide
    enough for convert's int4 groups of 32."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    cfg = DeepseekV2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        topk_method="greedy",
        max_position_embeddings=256,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return _save(out, DeepseekV2ForCausalLM, cfg)


def write_training_log(out: Path) -> None:
    """A small training_log.json in the format scripts/train_tiny_moe.py writes."""
    log = [
        {"step": s, "tokens": s * 4096, "seconds": s * 1.5, "lr": 1e-3, "loss": 6.0 - s / 100, "aux_loss": 2.0}
        for s in range(20, 220, 20)
    ]
    for entry in log[4::5]:
        entry["heldout_loss"] = entry["loss"] + 0.2
    meta = {
        "complete": True,
        "steps": 200,
        "train_tokens": 200 * 4096,
        "train_seconds": 300,
        "heldout_loss": 4.2,
        "heldout_ppl": 66.7,
        "threads": 2,
        "corpus": "Python standard library .py files",
        "commands": ["python scripts/train_tiny_moe.py --out tiny --minutes 5"],
    }
    cfg = {"seq_len": 64, "batch_size": 4, "heldout_fraction": 0.02, "max_corpus_bytes": 32_000_000}
    (out / "training_log.json").write_text(json.dumps({"config": cfg, **meta, "log": log}))
