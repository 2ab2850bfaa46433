"""fate-edge's GGUF tokenizer against llama.cpp on real vocabularies: llama.cpp's own tokenizer fixtures, the
vocab-only GGUFs of real models in its ``models/`` directory (``ggml-vocab-NAME.gguf``) with test texts (``.inp``) and
the ids llama.cpp gives them (``.out``), and llama.cpp itself (llama-cpp-python, ``vocab_only``) on more text.

The fixtures come from the llama-cpp-python sdist (:func:`fate_edge_lab.bench.gguf.sdist_candidates`) and are unpacked
once into the peers cache; none of them is in this repository.

Two ways of tokenizing are compared, each like for like:

- ``plain``: no BOS, special-token text tokenized as text (llama.cpp's ``add_special=false, parse_special=false``,
  the settings of its ``tests/test-tokenizer-0.cpp`` that wrote the ``.out`` files);
- ``runtime``: what fate-edge feeds the model, ``Tokenizer.encode(text)`` (BOS where the GGUF's ``add_bos`` says,
  special tokens in the text matched), against llama.cpp's ``add_special=true, parse_special=true``.
"""

from __future__ import annotations

import os
import shutil
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fate_edge.errors import PeerUnavailableError
from fate_edge.tokenizer import Tokenizer
from fate_edge_lab.bench.gguf import peers_cache, sdist_candidates

SEPARATOR = "\n__ggml_vocab_test__\n"  # between two texts of a .inp file (test-tokenizer-0.cpp's read_tests)
_MODELS = "vendor/llama.cpp/models/"

# The fixtures whose tokenizer.ggml.model / pre fate-edge rebuilds, and the models each stands for
VOCABS: dict[str, str] = {
    "llama-spm": "SentencePiece (llama): Mixtral, Mistral 7B, Llama 2",
    "phi-3": "SentencePiece (llama) with chat tokens: Phi-3",
    "qwen2": "qwen2: Qwen1.5-MoE, Qwen2-MoE, Qwen3-MoE",
    "deepseek-llm": "deepseek-llm: DeepSeek-LLM, DeepSeek-MoE, DeepSeek-V2(-Lite)",
    "deepseek-coder": "deepseek-coder: DeepSeek-Coder",
    "mpt": "GPT-NeoX vocabulary, GPT-2 split (as OLMoE's `olmo`)",
    "gpt-2": "gpt-2: GPT-2",
    "llama-bpe": "llama-bpe: Llama 3",
    "starcoder": "starcoder",
    "refact": "refact",
    "command-r": "command-r",
    "falcon": "falcon",
    "qwen35": "qwen35: Qwen3.5",
}

# Fixtures with keys changed, for settings no fixture has: name -> (fixture, {key: value})
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-spm-no-prefix": ("llama-spm", {"tokenizer.ggml.add_space_prefix": False}),
}
VOCABS["llama-spm-no-prefix"] = "llama-spm with add_space_prefix = false (as some SentencePiece GGUFs)"


def fixtures_missing() -> str | None:
    """Why the fixtures cannot be read here (no llama-cpp-python sdist), or None. Unpacks nothing."""
    if any(p.is_file() for p in sdist_candidates()):
        return None
    return (
        "llama.cpp's tokenizer fixtures (models/ggml-vocab-*.gguf) come from the llama-cpp-python sdist, and none "
        f"was found (looked in {', '.join(str(p) for p in sdist_candidates()) or peers_cache() / 'wheels'}); run "
        "`pip download --no-binary :all: --no-deps llama-cpp-python -d ~/.cache/fate-edge-peers/wheels` or set "
        "FATE_EDGE_LLAMACPP_SDIST"
    )


def fixtures_dir() -> Path:
    """The directory holding ``ggml-vocab-*.gguf`` and their ``.inp``/``.out``, unpacked from the sdist once."""
    missing = fixtures_missing()
    if missing:
        raise PeerUnavailableError(missing)
    sdist = next(p for p in sdist_candidates() if p.is_file())
    dest = peers_cache() / "vocab" / sdist.name.removesuffix(".tar.gz")
    if dest.is_dir():
        return dest
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}")  # renamed into place whole: no reader sees half of it
    tmp.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        for m in tar.getmembers():
            name = Path(m.name).name
            if m.isfile() and _MODELS in m.name and name.startswith("ggml-vocab-"):
                src = tar.extractfile(m)
                assert src is not None
                (tmp / name).write_bytes(src.read())
    try:
        tmp.rename(dest)
    except OSError:  # another process unpacked it first
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def vocab_path(name: str) -> Path:
    """The GGUF of fixture ``name``; a variant's is written beside the fixtures the first time."""
    path = fixtures_dir() / f"ggml-vocab-{name}.gguf"
    if name in VARIANTS and not path.exists():
        base, keys = VARIANTS[name]
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        with_keys(vocab_path(base), tmp, keys)
        tmp.rename(path)
    return path


def with_keys(src: Path, dst: Path, keys: dict[str, Any]) -> None:
    """``src`` (a vocab-only GGUF) written to ``dst`` by the gguf package with ``keys`` set (bool, int or str)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(src)
    writer = GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in keys:
            continue
        sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    kinds = {bool: GGUFValueType.BOOL, int: GGUFValueType.INT32, str: GGUFValueType.STRING}
    for name, value in keys.items():
        writer.add_key_value(name, value, kinds[type(value)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def read_cases(gguf: Path) -> list[tuple[str, list[int]]]:
    """``(text, llama.cpp's ids)`` of ``gguf``'s ``.inp``/``.out``, split as test-tokenizer-0.cpp splits them."""
    raw = Path(f"{gguf}.inp").read_bytes().decode("utf-8")  # bytes: no newline translation
    texts = raw.split(SEPARATOR)
    if texts and texts[-1] == "":  # the file ends with a separator: the reader stops there
        texts.pop()
    outs = Path(f"{gguf}.out").read_text().splitlines()
    if len(texts) != len(outs):
        raise ValueError(f"{gguf}: {len(texts)} texts but {len(outs)} lines of ids")
    return [(t, [int(x) for x in o.split()]) for t, o in zip(texts, outs)]


def gguf_tokenizer(gguf: Path, out_dir: Path) -> Tokenizer:
    """fate-edge's tokenizer for ``gguf`` (its metadata only: a vocab-only file has no tensors), as a store holds it."""
    from fate_edge.format.gguf_reader import GGUFFile
    from fate_edge.format.gguf_tokenizer import tokenizer_files, write_tokenizer_files

    write_tokenizer_files(tokenizer_files(GGUFFile(gguf)), out_dir)
    return Tokenizer(out_dir)


def ours(tok: Tokenizer, text: str, mode: str) -> list[int]:
    return tok.encode(text, add_special_tokens=mode == "runtime", parse_special=mode == "runtime")


def theirs(llm: Any, text: str, mode: str) -> list[int]:
    """llama.cpp's ids (``llm``: a ``llama_cpp.Llama`` opened with ``vocab_only=True``)."""
    return list(llm.tokenize(text.encode("utf-8"), add_bos=mode == "runtime", special=mode == "runtime"))


def chunks(text: str, size: int = 2000) -> list[str]:
    """``text`` cut after line ends into pieces of about ``size`` characters (each compared on its own)."""
    out, cur = [], ""
    for line in text.splitlines(keepends=True):
        cur += line
        if len(cur) >= size:
            out.append(cur)
            cur = ""
    return out + ([cur] if cur else [])


def special_texts(tok: Tokenizer, most: int = 12) -> list[str]:
    """Texts holding up to ``most`` of the vocabulary's control, unknown-type and user-defined tokens (spread over
    them in sorted order) after words, spaces and newlines and next to each other; none starts with one (fate-edge
    adds no second BOS to a text that starts with BOS's text, llama.cpp does)."""
    added = sorted(tok.added_tokens)
    picked = [added[i * len(added) // most] for i in range(most)] if len(added) > most else added
    texts = []
    for i, a in enumerate(picked):
        b = picked[(i + 1) % len(picked)]
        texts += [f"Hello{a} world", f"x {a}\n{b}  y", f"x{a}{b}", f"  {a} \n\n def f():{b}\n    return 1"]
    return texts


def edge_texts(runs: Iterable[int] = range(1, 41)) -> list[str]:
    """Runs of spaces, tabs and newlines (``runs`` long, alone and between words and brackets) and texts SentencePiece
    vocabularies treat specially: byte-token and control-token text, U+2581 itself, other spaces, control bytes. None
    starts with BOS's text (see :func:`special_texts`)."""
    texts = []
    for n in runs:
        for c in (" ", "\t", "\n"):
            texts += [c * n, f"a{c * n}b", f"{c * n}x", f"x{c * n}", f"({c * n})"]
    return texts + [
        " \t \n  \t\t\n\n   x",
        "<0x0A>",
        "a<0x0A>b<0x41>",
        "x<s>",
        "</s>",
        "<unk>x",
        "\u2581",
        "\u2581\u2581 \u2581x",
        "\u00a0 x\u3000y",
        "x\r\ny\r",
        "\x00\x7f\x1b[0m",
        "\U0001f999" * 3,
        "\ufffd",
    ]


@dataclass
class Agreement:
    """How many texts (and tokens, up to each text's first difference) give llama.cpp's ids."""

    texts: int = 0
    matched: int = 0
    tokens: int = 0  # llama.cpp's
    tokens_matched: int = 0
    first_misses: list[dict[str, Any]] = field(default_factory=list)

    def add(self, text: str, want: list[int], got: list[int], keep: int = 5) -> None:
        same = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        self.texts += 1
        self.tokens += len(want)
        if want == got:
            self.matched += 1
            self.tokens_matched += len(want)
            return
        self.tokens_matched += same
        if len(self.first_misses) < keep:
            self.first_misses.append(
                {
                    "text": text[max(0, len(text) - 80) :] if len(text) > 200 else text,
                    "at": same,
                    "llama.cpp": want[max(0, same - 2) : same + 6],
                    "ours": got[max(0, same - 2) : same + 6],
                }
            )

    @property
    def equal(self) -> bool:
        return self.texts == self.matched and self.tokens == self.tokens_matched
