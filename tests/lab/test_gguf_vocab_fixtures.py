"""fate-edge's tokenizer rebuilt from real models' GGUF tokenizer metadata gives llama.cpp's ids.

The vocabularies are llama.cpp's own tokenizer fixtures (``models/ggml-vocab-*.gguf`` of the llama-cpp-python
sdist: SentencePiece as Mixtral's, Qwen2's, DeepSeek's, Llama 3's, GPT-2's, ...), each with the ids llama.cpp gives
its test texts (``.inp``/``.out``). Where llama-cpp-python is installed, llama.cpp itself (``vocab_only``) is also
asked on held-out stdlib text, on texts holding the vocabulary's special tokens and on whitespace and byte edge
cases, plain and as fate-edge's runtime encodes (``fate_edge_lab.bench.gguf_vocab``). Without the sdist, or without the
package, those tests skip with the reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fate_edge.corpus import heldout_source
from fate_edge.format.gguf_tokenizer import CONTROL, NORMAL, USER_DEFINED, llama_cpp_types
from fate_edge.tokenizer import Tokenizer
from fate_edge_lab.bench import gguf_vocab as gv
from fate_edge_lab.bench.gguf import llama_cpp_missing

needs_fixtures = pytest.mark.skipif(gv.fixtures_missing() is not None, reason=str(gv.fixtures_missing()))
needs_llama_cpp = pytest.mark.skipif(llama_cpp_missing() is not None, reason=str(llama_cpp_missing()))
# The quick loop's vocabularies: those of the architectures fate-edge runs (Mixtral's SentencePiece, with and
# without the space prefix; Qwen's; DeepSeek-V2's; OLMoE's GPT-NeoX one, as mpt's) and GPT-2's; the others are
# marked slow (a plain run runs them): building and loading a 100k-250k vocabulary takes about a second here
QUICK = {"llama-spm", "llama-spm-no-prefix", "qwen2", "deepseek-llm", "mpt", "gpt-2"}


def _params(names: list[str]) -> list:
    return [pytest.param(n, marks=() if n in QUICK else pytest.mark.slow) for n in names]


FIXTURES = _params([n for n in gv.VOCABS if n not in gv.VARIANTS])
HELDOUT_CHARS = 20_000
RUNS = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33)  # whitespace runs: SentencePiece has pieces of 1-16 spaces


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """fate-edge's tokenizer of a fixture by name, built once per module from the GGUF's metadata."""
    built: dict[str, Tokenizer] = {}
    root = tmp_path_factory.mktemp("vocab")

    def get(name: str) -> Tokenizer:
        if name not in built:
            built[name] = gv.gguf_tokenizer(gv.vocab_path(name), root / name)
        return built[name]

    return get


def _report(label: str, a: gv.Agreement) -> str:
    return f"{label}: {a.matched}/{a.texts} texts; first differences {a.first_misses}"


@needs_fixtures
@pytest.mark.parametrize("name", FIXTURES)
def test_every_fixture_text_gets_llama_cpps_ids(tokenizer, name):
    """The .out ids: no BOS, special-token text read as text (llama.cpp's test-tokenizer-0 settings)."""
    tok = tokenizer(name)
    a = gv.Agreement()
    for text, want in gv.read_cases(gv.vocab_path(name)):
        a.add(text, want, gv.ours(tok, text, "plain"))
    assert a.texts >= 40 and a.equal, _report(name, a)


@needs_fixtures
@needs_llama_cpp
@pytest.mark.parametrize("name", _params(list(gv.VOCABS)))
def test_llama_cpp_gives_the_same_ids_on_more_text(tokenizer, name):
    from llama_cpp import Llama

    tok = tokenizer(name)
    llm = Llama(model_path=str(gv.vocab_path(name)), vocab_only=True, verbose=False)
    base = gv.VARIANTS[name][0] if name in gv.VARIANTS else name
    texts = [t for t, _ in gv.read_cases(gv.vocab_path(base))]
    texts += gv.special_texts(tok) + gv.edge_texts(RUNS) + gv.chunks(heldout_source(HELDOUT_CHARS)[0])
    for mode in ("plain", "runtime"):
        a = gv.Agreement()
        for text in texts:
            a.add(text, gv.theirs(llm, text, mode), gv.ours(tok, text, mode))
        assert a.equal, _report(f"{name} {mode}", a)


@needs_fixtures
def test_sentencepiece_space_prefix_follows_the_gguf(tokenizer):
    """llama.cpp prepends a space to each run of text (at the start and after an added token) unless
    tokenizer.ggml.add_space_prefix is false; the ids are llama.cpp's on the Llama 2 vocabulary."""
    with_prefix, without = tokenizer("llama-spm"), tokenizer("llama-spm-no-prefix")
    assert with_prefix.encode("Hello world", add_special_tokens=False) == [15043, 3186]  # '▁Hello' '▁world'
    assert without.encode("Hello world", add_special_tokens=False) == [10994, 3186]  # 'Hello' '▁world'
    assert with_prefix.encode("Hello</s> world") == [1, 15043, 2, 29871, 3186]
    assert without.encode("Hello</s> world") == [1, 10994, 2, 3186]
    for tok in (with_prefix, without):
        assert tok.decode(tok.encode(" Hello  world\n\tx", add_special_tokens=False)) == " Hello  world\n\tx"


@needs_fixtures
def test_phi3_end_of_text_is_a_control_token_and_its_specials_swallow_the_space_after(tokenizer):
    """Phi-3's '</s>' is stored user-defined; llama.cpp makes end-of-generation texts control tokens (read as text
    without parse_special) and gives Phi-3's added tokens but <unk>, <s> and <|endoftext|> rstrip."""
    tok = tokenizer("phi-3")
    assert tok.encode("Hello</s> world", parse_special=False) == [1, 15043, 829, 29879, 29958, 3186]
    assert tok.encode("Hello</s> world") == [1, 15043, 2, 3186]
    assert tok.encode("x <|user|>\n  y") == [1, 921, 29871, 32010, 343]
    assert 2 in tok.eos_token_ids and 32007 in tok.eos_token_ids  # '</s>', '<|end|>'


@needs_fixtures
@pytest.mark.slow
def test_llama3_adds_bos_where_the_gguf_does_not_say(tokenizer):
    """llama.cpp adds BOS for Llama 3's pre-tokenizers without tokenizer.ggml.add_bos_token (the fixture has none);
    other byte-level vocabularies without the key get none."""
    assert tokenizer("llama-bpe").encode("Hello") == [128000, 9906]
    assert tokenizer("gpt-2").encode("Hello") == [15496]


@needs_fixtures
def test_a_text_that_starts_with_bos_keeps_one_bos(tokenizer):
    """Where fate-edge differs from llama.cpp on purpose: a prompt whose text starts with BOS's (a chat template
    that writes it) gets no second BOS; llama.cpp adds one and warns (its chat path strips the template's)."""
    tok = tokenizer("llama-spm")
    assert tok.encode("<s>[INST] hi [/INST]")[:2] == [1, 518]


def test_end_of_generation_texts_are_control_tokens_as_llama_cpp_loads_them():
    tokens = ["a", "<|end|>", "<|return|>", "<|call|>", "</s>", "<|im_end|>"]
    types = llama_cpp_types(tokens, [NORMAL, CONTROL, CONTROL, CONTROL, NORMAL, USER_DEFINED])
    assert types == [NORMAL, USER_DEFINED, CONTROL, CONTROL, CONTROL, CONTROL]  # harmony's <|end|> is not EOG
    types = llama_cpp_types(["</s>", "<|tool_response>"], [CONTROL, USER_DEFINED])
    assert types == [NORMAL, CONTROL]  # Gemma 4's normal </s>


@needs_fixtures
def test_the_fixtures_are_read_as_llama_cpps_test_reads_them(tmp_path):
    cases = gv.read_cases(gv.vocab_path("llama-spm"))
    assert ("", []) in cases and (" ", [259]) in cases and ("\n", [29871, 13]) in cases
    fake = tmp_path / "ggml-vocab-x.gguf"
    Path(f"{fake}.inp").write_bytes(f"a\r\nb{gv.SEPARATOR}{gv.SEPARATOR}c{gv.SEPARATOR}".encode())
    Path(f"{fake}.out").write_text(" 1 2\n\n3\n")
    assert gv.read_cases(fake) == [("a\r\nb", [1, 2]), ("", []), ("c", [3])]


def test_without_the_sdist_the_reason_says_how_to_get_it(monkeypatch, tmp_path):
    from fate_edge.errors import PeerUnavailableError

    monkeypatch.setattr(gv, "sdist_candidates", lambda: [tmp_path / "absent.tar.gz"])
    assert "pip download --no-binary :all: --no-deps llama-cpp-python" in str(gv.fixtures_missing())
    with pytest.raises(PeerUnavailableError, match="absent.tar.gz"):
        gv.fixtures_dir()
