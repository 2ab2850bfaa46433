import pytest

from fate_edge import ModelFormatError, Tokenizer
from fate_edge.tokenizer import StreamingDetokenizer

SAMPLES = ["def main():\n    return 0\n", "import os, sys  # comment", "naïve café ünïcödé → ✓", ""]


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(bundled_tokenizer, text):
    ids = bundled_tokenizer.encode(text)
    assert bundled_tokenizer.decode(ids) == text


def test_bpe_compresses_python_source(bundled_tokenizer):
    text = "def __init__(self, name):\n        self.name = name\n"
    assert len(bundled_tokenizer.encode(text)) < len(text.encode()) / 2


def test_special_tokens_and_eos(bundled_tokenizer):
    tok = bundled_tokenizer
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    assert eot is not None and im_end is not None
    assert {eot, im_end} <= tok.eos_token_ids
    assert "<|im_start|>" in tok.special_tokens
    # Special tokens are single ids and are dropped when decoding for display.
    ids = tok.encode("<|im_start|>user")
    assert ids[0] == tok.token_to_id("<|im_start|>")
    assert tok.decode(ids) == "user"


def test_chat_template_renders_chatml(bundled_tokenizer):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = bundled_tokenizer.apply_chat_template(msgs)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert not bundled_tokenizer.apply_chat_template(msgs, add_generation_prompt=False).endswith("assistant\n")


def test_chat_template_is_sandboxed(model_copy):
    import json

    cfg_path = model_copy / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    cfg_path.write_text(json.dumps(cfg))
    (model_copy / "chat_template.jinja").unlink(missing_ok=True)
    from jinja2.exceptions import SecurityError

    with pytest.raises(SecurityError):
        Tokenizer(model_copy).apply_chat_template([{"role": "user", "content": "x"}])


def test_streaming_detokenizer_never_splits_characters(bundled_tokenizer):
    text = "print('héllo wörld ✓ 日本語')"
    ids = bundled_tokenizer.encode(text)
    detok = StreamingDetokenizer(bundled_tokenizer)
    pieces = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_missing_tokenizer_file_is_named(model_copy):
    (model_copy / "tokenizer.json").unlink()
    with pytest.raises(ModelFormatError, match="tokenizer.json"):
        Tokenizer(model_copy)
