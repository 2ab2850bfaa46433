"""Log-probabilities of tokens under the model's own distribution: ``log_softmax`` of the raw logits, before
temperature, repetition penalty or any truncation (what OpenAI and vLLM report by default)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs (and on the completions API's integer logprobs)


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # the ``n`` likeliest tokens, likeliest first


def logprob_rows(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """``tokens[i]``'s log-probability under ``logits[i]`` ([T, V]) and the ``top`` likeliest tokens of each row."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device).view(-1, 1)).view(-1).tolist()
    if top > 0:
        values, ids = torch.topk(lp, min(top, lp.shape[-1]), dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [[] for _ in tokens]
    return [TokenLogprob(t, c, tp) for t, c, tp in zip(tokens, chosen, tops)]


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """One sampled token's entry from its step's logits [V]."""
    return logprob_rows(logits.reshape(1, -1), [token], top)[0]
