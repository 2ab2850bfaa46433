"""A GGUF file's tokenizer metadata as the Hugging Face tokenizer files fate-edge reads (``tokenizer.json``,
``tokenizer_config.json``, ``generation_config.json``).

Byte-level BPE (``tokenizer.ggml.model = gpt2``: Qwen, OLMoE, DeepSeek): the vocabulary and merges as stored,
special tokens from the token types, and the pre-tokenizer llama.cpp applies for ``tokenizer.ggml.pre`` (its split
regexes, in order, from llama.cpp's ``llama-vocab.cpp``), so the ids are llama.cpp's own on the same text.
SentencePiece vocabularies (``llama``: Mixtral) become a byte-fallback BPE whose merges are ranked by the
stored piece scores, as llama.cpp's SPM tokenizer merges the highest-scoring pair first. Token types, BOS and the
space prefix are taken as llama.cpp's vocabulary loader takes them; tests/lab/test_gguf_vocab_fixtures.py checks the
ids against llama.cpp's own tokenizer fixtures (real models' vocabularies) and llama.cpp itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fate_edge.errors import ModelFormatError
from fate_edge.format.gguf_reader import GGUFFile

# Texts llama.cpp takes as end-of-generation tokens whatever the metadata says (llama-vocab.cpp's EOG scan); it
# also makes each such token a control token, so its text in a prompt is that token, not pieces of text
EOG_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",
    "[e~[",
)

# llama.cpp's token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2 = [
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
]
_QWEN2 = [
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^"
    "\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
]
_LLAMA3 = [
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}|"
    " ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
]
_DEEPSEEK3 = [
    "\\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?["
    "\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
]
_DEEPSEEK_LLM = [
    "[\r\n]",
    "\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-"
    "\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57"
    "\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-"
    "\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-"
    "\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184"
    "\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-"
    "\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-"
    "\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    "\\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    "\\p{N}+",
]
_STARCODER = [
    "\\p{N}",
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
]
_DEFAULT = [
    "[\\p{P}\\$\\+<=>\\^~\\|]+",
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
    "\\p{N}+",
    "[0-9][0-9][0-9]",
]

_DEEPSEEK_CODER = [
    "[\r\n]",
    "\\s?\\p{L}+",
    "\\s?\\p{P}+",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    "\\p{N}",
]
_FALCON = [
    "[\\p{P}\\$\\+<=>\\^~\\|`]+",
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
    "[0-9][0-9][0-9]",
]
_QWEN35 = [
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^"
    "\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
]

# tokenizer.ggml.pre -> (split regexes, ignore_merges): the names llama.cpp maps onto each regex set
_PRE: dict[str, tuple[list[str], bool]] = {
    **{n: (_GPT2, False) for n in ("gpt-2", "phi-2", "olmo", "mpt", "jais", "trillion", "granite-docling")},
    **{n: (_QWEN2, False) for n in ("qwen2", "deepseek-r1-qwen", "stablelm2", "hunyuan")},
    **{n: (_LLAMA3, True) for n in ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral")},
    **{n: (_LLAMA3, False) for n in ("dbrx", "smaug-bpe")},
    **{n: (_STARCODER, False) for n in ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone")},
    "deepseek-v3": (_DEEPSEEK3, False),
    "deepseek-llm": (_DEEPSEEK_LLM, False),
    "deepseek-coder": (_DEEPSEEK_CODER, False),
    "falcon": (_FALCON, False),
    "qwen35": (_QWEN35, False),
    "default": (_DEFAULT, False),
}
# Pre-tokenizers for which llama.cpp adds BOS when the GGUF has no tokenizer.ggml.add_bos_token (Llama 3's family);
# SentencePiece vocabularies add it by default, other byte-level ones do not
_BOS_BY_DEFAULT = {"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"}


def tokenizer_files(g: GGUFFile) -> dict[str, dict[str, Any]]:
    """``{"tokenizer.json": ..., "tokenizer_config.json": ..., "generation_config.json": ...}`` for ``g``."""
    with g.metadata_read("the tokenizer"):
        return _tokenizer_files(g)


def _tokenizer_files(g: GGUFFile) -> dict[str, dict[str, Any]]:
    kind = g.require("tokenizer.ggml.model")
    tokens: list[str] = g.require("tokenizer.ggml.tokens")
    types = llama_cpp_types(tokens, g.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    if kind == "gpt2":
        tok = _bpe_tokenizer(g, tokens, types)
    elif kind == "llama":
        tok = _spm_tokenizer(g, tokens, types)
    else:
        raise ModelFormatError(
            f"{g.path}: tokenizer.ggml.model is '{kind}'; fate-edge rebuilds 'gpt2' (byte-level "
            "BPE) and 'llama' (SentencePiece) tokenizers"
        )

    def text(key: str) -> str | None:
        i = g.get(key)
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    eos_ids = [
        g.get(k)
        for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if isinstance(g.get(k), int)
    ]
    eos_ids += [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (CONTROL, USER_DEFINED) and t in EOG_TEXTS]
    config: dict[str, Any] = {
        "bos_token": text("tokenizer.ggml.bos_token_id"),
        "eos_token": text("tokenizer.ggml.eos_token_id"),
        "pad_token": text("tokenizer.ggml.padding_token_id"),
        "unk_token": text("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": bool(
            g.get("tokenizer.ggml.add_bos_token", kind == "llama" or g.get("tokenizer.ggml.pre") in _BOS_BY_DEFAULT)
        ),
        "add_eos_token": bool(g.get("tokenizer.ggml.add_eos_token", False)),
    }
    if g.get("tokenizer.chat_template"):
        config["chat_template"] = g.get("tokenizer.chat_template")
    generation = {
        "bos_token_id": g.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": sorted(set(eos_ids)) if len(set(eos_ids)) > 1 else (eos_ids or [None])[0],
    }
    return {"tokenizer.json": tok, "tokenizer_config.json": config, "generation_config.json": generation}


def write_tokenizer_files(files: dict[str, dict[str, Any]], out_dir: str | Path) -> None:
    """Write :func:`tokenizer_files`' output into ``out_dir`` (a store's directory, or a bare tokenizer's)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        text = json.dumps(content, indent=1 if name != "tokenizer.json" else None, ensure_ascii=False)
        (out_dir / name).write_text(text, encoding="utf-8")


def llama_cpp_types(tokens: list[str], types: list[int]) -> list[int]:
    """The token types as llama.cpp's vocabulary loader leaves them: a token with an end-of-generation text is a
    control token whatever its stored type, but for the two exceptions llama-vocab.cpp makes (a harmony-style
    vocabulary's '<|end|>', a user-defined token; '</s>' beside '<|tool_response>' or '<|plamo:eos|>', a normal one)."""
    types = [CONTROL if t in EOG_TEXTS else ty for t, ty in zip(tokens, types)]
    present = set(tokens) & {*EOG_TEXTS, "<|plamo:eos|>"}
    if "<|end|>" in present and ({"<|return|>", "<|call|>"} <= present or {"<|calls|>", "<|flush|>"} <= present):
        types[tokens.index("<|end|>")] = USER_DEFINED
    if "</s>" in present and present & {"<|tool_response>", "<|plamo:eos|>"}:
        types[tokens.index("</s>")] = NORMAL
    return types


def _rstrip(g: GGUFFile, tokens: list[str], types: list[int]) -> set[int]:
    """Added tokens that swallow the whitespace after them in a prompt: llama.cpp sets that on Phi-3's (by the
    model's name), but for <unk>, <s> and <|endoftext|>."""
    name = str(g.get("general.name") or "").lower()
    if "phi-3" not in name and "phi3" not in name:
        return set()
    keep = {"<unk>", "<s>", "<|endoftext|>"}
    return {i for i, (t, ty) in enumerate(zip(tokens, types)) if ty in _ADDED and t not in keep}


_ADDED = (CONTROL, USER_DEFINED, UNKNOWN)  # matched in the text before the model splits it (llama.cpp's partition)


def _added(g: GGUFFile, tokens: list[str], types: list[int]) -> list[dict[str, Any]]:
    """Control, unknown-type and user-defined tokens, matched in the text as llama.cpp's partition matches them;
    the first two are special (read as text where llama.cpp does not parse special tokens), the last are not."""
    rstrip = _rstrip(g, tokens, types)
    return [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": i in rstrip,
            "normalized": False,
            "special": ty != USER_DEFINED,
        }
        for i, (t, ty) in enumerate(zip(tokens, types))
        if ty in _ADDED
    ]


def _bpe_tokenizer(g: GGUFFile, tokens: list[str], types: list[int]) -> dict[str, Any]:
    pre = g.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE:
        raise ModelFormatError(
            f"{g.path}: tokenizer.ggml.pre is '{pre}', a pre-tokenizer fate-edge does not know; "
            f"known: {', '.join(sorted(_PRE))}"
        )
    regexes, ignore_merges = _PRE[pre]
    splits = [{"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False} for r in regexes]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added(g, tokens, types),
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                *splits,
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": ignore_merges,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": list(g.require("tokenizer.ggml.merges")),
        },
    }


def _spm_tokenizer(g: GGUFFile, tokens: list[str], types: list[int]) -> dict[str, Any]:
    """llama.cpp's SPM tokenizer: ' ' escaped to '\u2581' (and one prepended to each run of text unless
    tokenizer.ggml.add_space_prefix is false: at the start and after each added token), then adjacent pieces merged
    while their concatenation is in the vocabulary, highest score first, any token type; a character outside the
    vocabulary becomes its UTF-8 bytes' <0xNN> tokens."""
    scores: list[float] = g.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = g.get("tokenizer.ggml.merges")
    if not merges:  # every split of every piece into two pieces, ranked by the whole piece's score, highest first
        found = []
        for piece, i in vocab.items():
            if len(piece) < 2 or " " in piece:  # a ' ' never reaches the merges: the text's are escaped
                continue
            for cut in range(1, len(piece)):
                left, right = piece[:cut], piece[cut:]
                if left in vocab and right in vocab:
                    found.append((-scores[i], i, left, right))
        merges = [f"{left} {right}" for _, _, left, right in sorted(found)]
    unk = g.get("tokenizer.ggml.unknown_token_id")
    prefix = bool(g.get("tokenizer.ggml.add_space_prefix", True))
    escape = [{"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]
    decoders: list[dict[str, Any]] = [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added(g, tokens, types),
        "normalizer": {
            "type": "Sequence",
            "normalizers": [{"type": "Prepend", "prepend": "\u2581"}, *escape] if prefix else escape,
        },
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {
            "type": "Sequence",
            "decoders": [*decoders, {"type": "Strip", "content": " ", "start": 1, "stop": 0}] if prefix else decoders,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": tokens[unk] if isinstance(unk, int) else None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }
