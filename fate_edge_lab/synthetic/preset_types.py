"""What a preset holds (:class:`Preset`), and the chat format and special tokens several presets share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Preset:
    """One published MoE checkpoint: its config.json and the tokenizer facts a synthetic copy reproduces."""

    name: str  # the --like name
    source: str  # where the numbers below come from
    config: dict[str, Any]  # the published config.json
    special_tokens: dict[str, int]  # token text -> its published id
    tokenizer_config: dict[str, Any]  # bos/eos/pad token texts, add_bos_token
    generation_config: dict[str, Any]
    chat_template: str
    published_params: float  # total parameters the model card states


_QWEN_SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
