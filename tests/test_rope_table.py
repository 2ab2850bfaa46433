"""The rotary table grows with the positions used, in powers of two, and gives the rows a whole-context table has."""

from __future__ import annotations

import torch

from fate_edge.model.arch.base import RopeConfig
from fate_edge.model.rope import RotaryEmbedding

CPU32 = (torch.device("cpu"), torch.float32)  # tables are kept per (device, dtype)


def test_table_covers_the_positions_used_and_matches_the_whole_context():
    yarn = RopeConfig(
        theta=10000.0,
        rope_type="yarn",
        factor=40.0,
        original_max_position_embeddings=4096,
        mscale=0.707,
        mscale_all_dim=0.707,
    )  # DeepSeek-V2-Lite's rope, 163840 positions
    rope = RotaryEmbedding(yarn, 64, 163840)
    whole_cos, whole_sin = rope.cos_sin(torch.arange(163840), torch.float32)
    cos, sin = rope.cos_sin_range(0, 64, torch.float32)
    assert rope._tables[CPU32][0].shape[0] == 1024  # a 64-token prompt builds 1024 rows, not 163840
    assert torch.equal(cos, whole_cos[:64]) and torch.equal(sin, whole_sin[:64])
    cos, sin = rope.cos_sin_range(3000, 200, torch.float32)  # past the table: it grows to the next power of two
    assert rope._tables[CPU32][0].shape[0] == 4096
    assert torch.equal(cos, whole_cos[3000:3200]) and torch.equal(sin, whole_sin[3000:3200])
    rope.cos_sin_range(163000, 840, torch.float32)  # never past the context
    assert rope._tables[CPU32][0].shape[0] == 163840
