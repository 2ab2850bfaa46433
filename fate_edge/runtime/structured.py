"""Grammar-constrained decoding: a token mask from llguidance applied to the logits before sampling.

A request's :attr:`GenerateConfig.grammar` is llguidance grammar text (JSON schema or Lark, built by the helpers
here); each step, :class:`GrammarMask` computes the tokens the grammar allows next, sets every other logit to
-inf (greedy and sampled decoding alike), and after sampling advances the grammar by the chosen token. The answer
ends when the grammar has accepted and allows nothing more (or at EOS, which it allows only where it accepts).

llguidance over xgrammar: a 3 MB wheel with no dependencies (xgrammar needs transformers and triton at run time),
and the lower mask cost per token measured on the bundled model (docs/server.md, research/grammar_mask_cost.py).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np
import torch

from fate_edge.errors import GenerationError, GrammarError
from fate_edge.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# Compact separators as json.dumps writes them, and no free whitespace: a small model given free whitespace can
# spend its whole budget on blanks.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _checked(grammar: str) -> str:
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(error)
    return grammar


def json_schema_grammar(schema: dict[str, Any] | None) -> str:
    """Grammar text for JSON matching ``schema`` (None: any JSON object); :class:`GrammarError` if refused."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            ANY_OBJECT if schema is None else schema, overrides=JSON_OPTIONS
        )
    except (ValueError, TypeError) as exc:
        raise GrammarError(str(exc)) from None
    return _checked(grammar)


def lark_grammar(lark: str) -> str:
    """Grammar text from a Lark grammar (which may embed ``%json {schema}``); :class:`GrammarError` if refused."""
    return _checked(llguidance.LLMatcher.grammar_from_lark(lark))


def lark_literal(text: str) -> str:
    """``text`` as a Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def lark_json(schema: dict[str, Any]) -> str:
    """A Lark expression for JSON matching ``schema``, with the same separators as :func:`json_schema_grammar`."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def _ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of ``tokenizer``, built once per tokenizer (it takes a while)."""
    cached = getattr(tokenizer, "_llguidance", None)
    if cached is None:
        cached = llguidance.LLTokenizer(
            tokenizer._tok.to_str(), n_vocab=tokenizer.vocab_size, eos_token=sorted(tokenizer.eos_token_ids) or None
        )
        tokenizer._llguidance = cached  # type: ignore[attr-defined]
    return cached


class GrammarMask:
    """One request's grammar state: the mask for its next token and the tokens it has taken."""

    def __init__(self, tokenizer: Tokenizer, grammar: str):
        self.ll_tokenizer = _ll_tokenizer(tokenizer)
        self.matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar)
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())
        words = (self.ll_tokenizer.vocab_size + 31) // 32
        self._bits = np.zeros(words, dtype=np.int32)

    def allowed(self) -> np.ndarray:
        """A boolean array over the tokenizer's vocabulary: which tokens the grammar allows next."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        return bits[: self.ll_tokenizer.vocab_size].astype(bool)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of ``logits`` [V] in fp32 with every token the grammar does not allow at -inf (the model's vocabulary
        may be padded past the tokenizer's: the padding is never allowed)."""
        allowed = self.allowed()
        if self.matcher.is_error():
            raise GenerationError(f"the grammar failed: {self.matcher.get_error()}")
        n = min(allowed.size, logits.numel())
        if logits.device.type == "cpu":  # in numpy: a few µs where each torch operator costs several
            values = logits.detach().reshape(-1).float().numpy()
            out = np.full(values.size, -np.inf, dtype=np.float32)
            np.copyto(out[:n], values[:n], where=allowed[:n])
            return torch.from_numpy(out)
        keep = torch.from_numpy(allowed[:n]).to(logits.device)
        masked = torch.full(logits.shape, float("-inf"), dtype=torch.float32, device=logits.device)
        masked[:n] = torch.where(keep, logits[:n].float(), masked[:n])
        return masked

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GenerationError(f"the grammar refused token {token}: {self.matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """The grammar has accepted and allows no further token (EOS aside)."""
        return self.matcher.is_stopped()
