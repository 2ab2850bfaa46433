"""sampling.greedy picks what torch.argmax picks: first of ties, NaN as largest, any dtype and shape."""

import pytest
import torch

from fate_edge.runtime.sampling import greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_torch_argmax_on_random_logits(dtype):
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(1, 1, 5000, generator=gen).to(dtype)
        assert greedy(logits) == int(torch.argmax(logits))
        assert greedy(logits[0, 0]) == int(torch.argmax(logits))


def test_ties_take_the_first_and_nan_counts_as_largest():
    logits = torch.zeros(10)
    logits[3] = logits[7] = 1.0
    assert greedy(logits) == 3 == int(torch.argmax(logits))
    logits[8] = float("nan")
    logits[9] = float("nan")
    assert greedy(logits) == 8 == int(torch.argmax(logits))


def test_a_strided_view_reads_the_right_elements():
    logits = torch.arange(20.0).view(2, 10).t()[::2]  # non-contiguous
    assert greedy(logits) == int(torch.argmax(logits))
