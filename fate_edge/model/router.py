"""Routers: map a token's gate logits to its top-k experts and their weights.

* ``softmax``: Mixtral, Qwen-MoE, OLMoE (softmax over all experts, top-k, optional renormalisation); ERNIE-4.5
  chooses on the probabilities plus a selection-only bias.
* ``deepseek_v2``: softmax, greedy or group-limited top-k (best expert per group), times routed_scaling_factor.
* ``deepseek_v3``: sigmoid scores; selection on scores + e_score_correction_bias within the top groups
  (ranked by the sum of their two best biased scores); weights from the unbiased scores, optionally
  renormalised, times routed_scaling_factor.
* ``topk_softmax``: gpt-oss: top-k of the logits (its router has a bias), weights the softmax over those k.
"""

from __future__ import annotations

import torch

from fate_edge.model.arch.base import ModelConfig


def _group_mask(scores: torch.Tensor, n_group: int, topk_group: int, group_scores: torch.Tensor) -> torch.Tensor:
    n, e = scores.shape
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]  # [N, topk_group]
    mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    return mask.unsqueeze(-1).expand(n, n_group, e // n_group).reshape(n, e).bool()


def route(
    cfg: ModelConfig, logits: torch.Tensor, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` [N, E] → (weights [N, k] float32, expert indices [N, k])."""
    k = cfg.num_experts_per_tok
    logits = logits.float() if logits.dtype != torch.float32 else logits
    if cfg.router == "softmax":
        probs = torch.softmax(logits, dim=-1)
        if correction_bias is not None:  # ERNIE-4.5: chosen on probs + bias, weighted by the probs alone
            idx = torch.topk(probs + correction_bias, k, dim=-1)[1]
            weights = probs.gather(1, idx)
        else:
            weights, idx = torch.topk(probs, k, dim=-1)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, idx
    if cfg.router == "topk_softmax":
        top, idx = torch.topk(logits, k, dim=-1)
        return top.softmax(dim=-1), idx
    e = logits.shape[-1]
    if cfg.router == "deepseek_v2":
        scores = logits.softmax(dim=-1)
        if cfg.topk_method == "group_limited_greedy":
            group_scores = scores.view(-1, cfg.n_group, e // cfg.n_group).max(dim=-1).values
            scores = scores.masked_fill(~_group_mask(scores, cfg.n_group, cfg.topk_group, group_scores), 0.0)
        weights, idx = torch.topk(scores, k=k, dim=-1, sorted=False)
        return weights * cfg.routed_scaling_factor, idx
    if cfg.router == "deepseek_v3":
        scores = logits.sigmoid()
        choice = scores + correction_bias if correction_bias is not None else scores
        group_scores = choice.view(-1, cfg.n_group, e // cfg.n_group).topk(2, dim=-1)[0].sum(dim=-1)
        choice = choice.masked_fill(~_group_mask(choice, cfg.n_group, cfg.topk_group, group_scores), float("-inf"))
        idx = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, idx)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + cfg.topk_norm_eps)
        return weights * cfg.routed_scaling_factor, idx
    raise ValueError(f"unknown router '{cfg.router}'")
