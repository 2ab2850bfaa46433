"""Grouping a batch's (token, expert) assignments by expert for the multi-token MoE block.

One stable sort of the flattened top-k ids gives every expert a contiguous slice of rows (its tokens in
token order), so the block gathers its inputs once, calls each expert on a slice, and adds the weighted
outputs back with one ``index_add_``: no per-expert mask, ``nonzero`` or indexed scatter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ExpertGroups:
    order: torch.Tensor  # [N*k] positions in idx.flatten(), grouped by expert id (stable: token order within)
    tokens: torch.Tensor  # [N*k] the token of each grouped row
    ids: list[int]  # experts with at least one token, ascending
    starts: list[int]  # first grouped row of each of ``ids``
    counts: dict[int, int]  # rows per expert

    def by_rank(self, idx: torch.Tensor) -> torch.Tensor:
        """A permutation of the grouped rows into ``k`` blocks of ``N``: block ``j`` holds every token's ``j``-th
        expert by id (each token once per block), tokens in order."""
        rank = idx.argsort(dim=1).argsort(dim=1).flatten().index_select(0, self.order)  # rank of each grouped row
        return (rank * idx.shape[0] + self.tokens).argsort()

    def by_popularity(self) -> list[int]:
        """Expert ids, most tokens first (ties: lower id first): the order the block asks the provider for."""
        return sorted(self.ids, key=lambda e: -self.counts[e])


def group_by_expert(idx: torch.Tensor) -> ExpertGroups:
    """``idx`` [N, k] expert ids per token → the assignments grouped by expert."""
    flat = idx.flatten()
    order = flat.argsort(stable=True)
    tokens = order // idx.shape[1]
    ids, counts = flat.unique(return_counts=True)  # ascending ids
    ids_l, counts_l = ids.tolist(), counts.tolist()
    starts, at = [], 0
    for c in counts_l:
        starts.append(at)
        at += c
    return ExpertGroups(order, tokens, ids_l, starts, dict(zip(ids_l, counts_l)))
