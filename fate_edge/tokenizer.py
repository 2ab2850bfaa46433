"""Tokenizer (``tokenizer.json`` via the ``tokenizers`` library), special tokens and chat templates.

Chat templates come from ``tokenizer_config.json`` (``chat_template``, a string or a list of named
templates) or ``chat_template.jinja`` (transformers 5), and are rendered in jinja2's immutable
sandbox: a template shipped with a downloaded model must not be able to reach Python internals.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from fate_edge.errors import ModelFormatError
from fate_edge.small_files import CONFIG_MAX_BYTES, read_json_object, read_small_text

TOKENIZER_MAX_BYTES = 256 << 20  # a 256k-token vocabulary's tokenizer.json is ~35 MB


def _token_text(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise ModelFormatError(
                f"{path}: not found; fate-edge needs the fast-tokenizer file tokenizer.json "
                "(create it with transformers: AutoTokenizer.from_pretrained(dir).save_pretrained(dir))"
            )
        text = read_small_text(path, TOKENIZER_MAX_BYTES)
        try:
            self._tok = _HFTokenizer.from_str(text)
        except Exception as exc:  # tokenizers raises plain Exceptions
            raise ModelFormatError(f"{path}: cannot be parsed by the tokenizers library ({exc})") from exc
        cfg = _read_json(model_dir / "tokenizer_config.json")
        gen = _read_json(model_dir / "generation_config.json")
        model_cfg = _read_json(model_dir / "config.json")
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.add_bos = bool(cfg.get("add_bos_token", False)) and self.bos_token_id is not None
        eos_ids: set[int] = set()
        for source in (gen.get("eos_token_id"), model_cfg.get("eos_token_id")):
            if isinstance(source, int):
                eos_ids.add(source)
            elif isinstance(source, list):
                eos_ids.update(source)
        eos_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        if eos_id is not None:
            eos_ids.add(eos_id)
        self.eos_token_ids = eos_ids
        self.added_tokens = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        self.special_tokens = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        self._as_text: _HFTokenizer | None = None  # a copy that reads special-token text as text (parse_special)
        self.chat_template = _find_chat_template(model_dir, cfg)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """``text``'s ids, BOS first where the model adds one; ``parse_special=False`` tokenizes the text of special
        tokens ("<s>", "<|im_end|>") as text, as llama.cpp does without ``parse_special`` (user-defined tokens are
        matched either way, in llama.cpp too)."""
        tok = self._tok
        if not parse_special:
            if self._as_text is None:  # a copy: the flag is the tokenizer's state, and other threads may encode
                self._as_text = _HFTokenizer.from_str(self._tok.to_str())
                self._as_text.encode_special_tokens = True
            tok = self._as_text
        ids = tok.encode(text, add_special_tokens=False).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kw) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}]) with the model's chat template."""
        if not self.chat_template:
            raise ModelFormatError(
                "this model has no chat template (no 'chat_template' in tokenizer_config.json and no "
                "chat_template.jinja); use plain completion or add a template"
            )
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        return env.from_string(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kw,
        )


class StreamingDetokenizer:
    """Turns a growing token list into text deltas without splitting multi-byte characters.

    Re-decodes only a short window (prefix/read offsets, as TGI and vLLM do), so streaming stays linear.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, token: int) -> str:
        self.tokens.append(token)
        prefix = self.tokenizer.decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.tokens[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        prefix = self.tokenizer.decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.tokens[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.tokens)
        return full[len(prefix) :]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    return read_json_object(path)


def _find_chat_template(model_dir: Path, cfg: dict[str, Any]) -> str | None:
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    jinja = model_dir / "chat_template.jinja"
    if not template and jinja.exists():
        template = read_small_text(jinja, CONFIG_MAX_BYTES)
    return template or None
