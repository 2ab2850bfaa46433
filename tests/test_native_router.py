"""The softmax router in one native call (fate_edge.model.native_router): torch's choice of experts and its weights
to float32 rounding, a row's bits the same whatever rows share its call, ties left to torch, and the model's layers
routing through it on the CPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from fate_edge import bundled_model_dir, load_model
from fate_edge.model import native_router
from fate_edge.model.layer_step import router_block
from fate_edge.model.router import route

pytestmark = pytest.mark.skipif(
    not native_router.available()[0], reason=f"no native router kernel: {native_router.available()[1]}"
)


def config(k: int, renorm: bool, router: str = "softmax") -> SimpleNamespace:
    return SimpleNamespace(router=router, num_experts_per_tok=k, norm_topk_prob=renorm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("renorm", [False, True])
@pytest.mark.parametrize(("experts", "hidden", "k"), [(60, 2048, 4), (8, 40, 2), (128, 2056, 8), (4, 64, 4)])
def test_torch_routes_the_same_experts_with_the_same_weights_to_rounding(dtype, renorm, experts, hidden, k):
    g = torch.Generator().manual_seed(experts + hidden)
    gate = torch.randn(experts, hidden, generator=g) * 0.05
    h = (torch.randn(37, hidden, generator=g) * 2).to(dtype)
    cfg = config(k, renorm)
    assert native_router.takes(cfg, h, gate, None)
    got = native_router.route_softmax(cfg, h, gate)
    assert got is not None
    want = route(cfg, F.linear(h.float(), gate))
    assert torch.equal(got[1], want[1])  # the same experts, largest first
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.int64
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_is_routed_the_same_alone_as_beside_others(threads):
    g = torch.Generator().manual_seed(3)
    gate = torch.randn(60, 2048, generator=g) * 0.02
    h = torch.randn(21, 2048, generator=g).to(torch.bfloat16)
    cfg = config(4, False)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = native_router.route_softmax(cfg, h, gate)
        assert together is not None
        for r in range(h.shape[0]):
            alone = native_router.route_softmax(cfg, h[r : r + 1], gate)
            assert alone is not None
            assert torch.equal(alone[0][0], together[0][r]) and torch.equal(alone[1][0], together[1][r])
        pairs = native_router.route_softmax(cfg, h[5:7], gate)  # a block of two rows, computed together
        assert pairs is not None and torch.equal(pairs[0], together[0][5:7])
    finally:
        torch.set_num_threads(before)


def test_a_tie_in_the_top_k_is_left_to_torch():
    g = torch.Generator().manual_seed(5)
    gate = torch.randn(8, 64, generator=g) * 0.1
    cfg = config(2, False)
    tied = torch.zeros(1, 64)  # every logit 0: all eight experts tie
    assert native_router.route_softmax(cfg, tied, gate) is None
    lp = SimpleNamespace(router=gate, router_bias=None, correction_bias=None)
    weights, ids = router_block(cfg, tied, lp)  # the layer falls back to torch's operators
    want = route(cfg, F.linear(tied, gate))
    assert torch.equal(ids, want[1]) and torch.equal(weights, want[0])
    gate[5] = gate[3]  # experts 3 and 5 now always score alike
    assert native_router.route_softmax(cfg, gate[3:4] * 50, gate) is None  # the pair on top: a tie
    assert native_router.route_softmax(cfg, gate[1:2] * 50, gate) is not None  # the pair far below: no matter


def test_a_nan_row_is_left_to_torch():
    gate = torch.randn(8, 64)
    h = torch.randn(2, 64)
    h[1, 7] = float("nan")
    assert native_router.route_softmax(config(2, False), h, gate) is None


@pytest.mark.parametrize(
    "change",
    ["deepseek router", "a router bias", "a bf16 gate", "rows of three dimensions", "k above the kernel's"],
)
def test_what_the_kernel_does_not_take_stays_with_torch(change):
    cfg, gate, h, bias = config(2, False), torch.randn(8, 64), torch.randn(3, 64), None
    if change == "deepseek router":
        cfg = config(2, False, "deepseek_v2")
    elif change == "a router bias":
        bias = torch.zeros(8)
    elif change == "a bf16 gate":
        gate = gate.bfloat16()
    elif change == "rows of three dimensions":
        h = h.view(1, 3, 64)
    else:
        cfg, gate = config(native_router.MAX_K + 1, False), torch.randn(native_router.MAX_K + 2, 64)
    assert not native_router.takes(cfg, h, gate, bias)


def test_the_bundled_models_layers_route_through_it(monkeypatch):
    model = load_model(bundled_model_dir(), device="cpu")
    calls = []
    real = native_router.route_softmax

    def counted(cfg, h, gate):
        calls.append(h.shape[0])
        return real(cfg, h, gate)

    monkeypatch.setattr(native_router, "route_softmax", counted)
    model(torch.tensor([[5, 17, 42, 9]]), model.new_cache())  # a prompt: every row in one call a layer
    moe_layers = sum(1 for lp in model.plan() if lp.router is not None)
    assert moe_layers > 0 and calls == [4] * moe_layers
