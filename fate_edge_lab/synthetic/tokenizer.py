"""A byte-level BPE tokenizer for a synthetic checkpoint, with the published special tokens at their published ids.

The BPE is trained quickly on Python standard-library source (any text encodes: byte-level); its ids
skip the published special-token ids, so ``bos_token_id`` / ``eos_token_id`` in config.json and
generation_config.json mean the same tokens as in the real model and every id fits ``vocab_size``.
"""

from __future__ import annotations

import json
import sysconfig
from functools import lru_cache
from pathlib import Path
from typing import Any

from fate_edge_lab.synthetic.presets import Preset

DEFAULT_BPE_VOCAB = 8192
TRAIN_CHARS = 2_000_000  # ~2 MB of stdlib source: a few seconds of training


def stdlib_texts(max_chars: int) -> list[str]:
    from fate_edge.planning.calibrate import read_texts

    return read_texts(Path(sysconfig.get_paths()["stdlib"]), max_chars)


def train_bpe(texts: list[str], vocab_size: int) -> dict[str, Any]:
    """tokenizer.json (as a dict) of a byte-level BPE with ``vocab_size`` tokens and no special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return json.loads(tok.to_str())


@lru_cache(maxsize=4)
def _trained_bpe(train_chars: int, vocab_size: int) -> str:
    """train_bpe on the first ``train_chars`` of stdlib source, as JSON text: the same for every preset of one
    size, so a process writing several checkpoints (the lab's tests, a sweep) trains it once."""
    return json.dumps(train_bpe(stdlib_texts(train_chars), vocab_size))


def place_specials(tokenizer: dict[str, Any], specials: dict[str, int]) -> dict[str, Any]:
    """Renumber the BPE ids around the ``specials`` ids and add the specials (text → id) as special tokens."""
    reserved = set(specials.values())
    ordered = sorted(tokenizer["model"]["vocab"].items(), key=lambda kv: kv[1])
    vocab, next_id = {}, 0
    for text, _ in ordered:  # merges refer to token texts, so renumbering keeps the BPE intact
        while next_id in reserved:
            next_id += 1
        vocab[text] = next_id
        next_id += 1
    vocab.update(specials)
    tokenizer["model"]["vocab"] = vocab
    tokenizer["added_tokens"] = [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for t, i in sorted(specials.items(), key=lambda kv: kv[1])
    ]
    return tokenizer


def write_tokenizer(
    out: Path,
    preset: Preset,
    config: dict[str, Any],
    bpe_vocab: int = DEFAULT_BPE_VOCAB,
    train_chars: int = TRAIN_CHARS,
) -> int:
    """tokenizer.json, tokenizer_config.json and generation_config.json in ``out``; returns the largest token id."""
    vocab_size = config["vocab_size"]
    size = min(bpe_vocab, vocab_size - len(preset.special_tokens))
    tok = place_specials(json.loads(_trained_bpe(train_chars, size)), preset.special_tokens)
    top = max(tok["model"]["vocab"].values())
    if top >= vocab_size:
        raise ValueError(f"token id {top} does not fit vocab_size {vocab_size}; lower the BPE vocabulary")
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    tok_cfg = {
        **preset.tokenizer_config,
        "chat_template": preset.chat_template,
        "model_max_length": config["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    (out / "generation_config.json").write_text(json.dumps(preset.generation_config, indent=2) + "\n")
    return top
