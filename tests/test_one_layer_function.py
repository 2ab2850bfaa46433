"""Every way a forward pass runs is the one layer function (``fate_edge.model.layer_step.decoder_layer``) with its
own attention state and expert source: the general path (prompts, and decode for the architectures the one-token step
does not cover), the one-token decode step, a batched step, and the static steps the compiled and captured decodes
run (``capture=False``: the CUDA graphs' code, uncaptured). Each is counted through ``layer_step.router_block``,
which only the layer function calls, and their logits for the same token agree."""

import pytest
import torch
from _tiny_moe import build_tiny_moe

from fate_edge import load_model
from fate_edge.model import attention, layer_step
from fate_edge.model.batch_step import Segment, forward_segments
from fate_edge.model.graph_step import CudaGraphDecode, LayerGraphDecode

PROMPT = torch.tensor([[5, 9, 17, 3, 41, 7, 88, 13]])
OTHER = torch.tensor([[61, 2, 30]])  # a second sequence for the batched step
NEXT = 23
PATHS = ["general", "one-token", "batched", "whole-step graph", "layer graphs"]


@pytest.fixture(scope="module")
def top4(tmp_path_factory):
    """Top-4 of 8 experts (sums of four experts per token), a gated shared expert and a dense layer (layer 2)."""
    return load_model(build_tiny_moe(tmp_path_factory.mktemp("one-layer") / "m", top_k=4, expert_dim=32))


def router_rows(monkeypatch) -> list[int]:
    """Rows each call of the layer function's router saw, from now on."""
    rows: list[int] = []
    real = layer_step.router_block
    monkeypatch.setattr(layer_step, "router_block", lambda cfg, h, lp: rows.append(h.shape[0]) or real(cfg, h, lp))
    return rows


def next_logits(model, path: str, rows: list[int]) -> torch.Tensor:
    """Prefill PROMPT, then NEXT through ``path`` → its logits [V]; ``rows`` counts only the decode step."""
    cache = model.new_cache()
    with torch.inference_mode():
        model(PROMPT, cache)
        if path == "batched":
            other = model.new_cache()
            model(OTHER, other)
            rows.clear()
            return forward_segments(model, [Segment([NEXT], cache), Segment([11], other)])[0]
        model.fast_decode = path != "general"
        if path == "whole-step graph":
            model.runner = CudaGraphDecode(model, capture=False)
        elif path == "layer graphs":
            model.runner = LayerGraphDecode(model, capture=False)
        rows.clear()
        try:
            return model(torch.tensor([[NEXT]]), cache)[0, -1]
        finally:
            model.runner, model.fast_decode = None, True


@pytest.mark.parametrize("path", PATHS)
def test_every_decode_path_runs_the_one_layer_function(top4, path, monkeypatch, one_thread):
    rows = router_rows(monkeypatch)
    next_logits(top4, path, rows)
    moe_layers = len(top4.config.moe_layers)
    assert moe_layers == top4.config.num_hidden_layers - 1  # the dense layer has no router
    assert rows == [2 if path == "batched" else 1] * moe_layers


@pytest.mark.parametrize("path", PATHS)
def test_every_decode_path_attends_through_the_one_attention(top4, path, monkeypatch, one_thread):
    """One GQA attention (``attention.attend``) over one state interface serves every path: each sequence's keys
    are read there once per layer, whatever holds them (a growing cache, a batch's parts, a static buffer)."""
    leaves: list[str] = []
    real = attention.attend

    def counted(cfg, q, held, layer, scale, sinks=None):
        if q.shape[2] == 1 and (type(held) is tuple or held.parts is None):  # decode rows; a batch's parts recurse
            leaves.append("prefix" if type(held) is tuple else "masked" if held.mask is not None else "rows")
        return real(cfg, q, held, layer, scale, sinks)

    monkeypatch.setattr(attention, "attend", counted)
    rows = router_rows(monkeypatch)
    next_logits(top4, path, rows)
    sequences = 2 if path == "batched" else 1
    assert len(leaves) == top4.config.num_hidden_layers * sequences
    assert set(leaves) == {"masked" if "graph" in path else "prefix"}


def test_prompts_run_it_too(top4, monkeypatch, one_thread):
    rows = router_rows(monkeypatch)
    with torch.inference_mode():
        top4(PROMPT, top4.new_cache())
    assert rows == [PROMPT.shape[1]] * len(top4.config.moe_layers)


def test_the_paths_agree_on_a_token(top4, monkeypatch, one_thread):
    """fp32: the paths differ only in their attention kernels (rope as a matrix, a masked whole-buffer attention,
    a gathered batch attention), not in how a layer's experts are summed."""
    rows = router_rows(monkeypatch)
    logits = {path: next_logits(top4, path, rows) for path in PATHS}
    ref = logits["general"]
    for path, got in logits.items():
        assert torch.equal(got.argmax(), ref.argmax()), path
        assert ((got - ref).norm() / ref.norm()).item() < 1e-5, path


def test_a_decode_row_beside_a_prompt_chunk_gets_its_bits_alone(bundled_dir, one_thread):
    """int4 experts on torch's kernel compute a decode token's row in bf16 and a prompt's rows in float32
    (layer_step.expert_rows): by the row's role, so a decode row batched beside a joining prompt's chunk gets the
    sum it gets alone, and the prompt's rows the sums they get without it."""
    from test_decode_step import store_int4_model

    from fate_edge.model.layer_step import moe_sum
    from fate_edge.model.routed_experts import routed_grouped, routed_one

    model = store_int4_model(bundled_dir)
    layer, hidden = model.config.moe_layers[0], model.config.hidden_size
    gen = torch.Generator().manual_seed(3)
    h, x = torch.randn(5, hidden, generator=gen), torch.randn(5, hidden, generator=gen)
    weights, idx = model.route(layer, h)
    decode = torch.tensor([False, False, True, False, False])  # row 2: a decode token
    with torch.inference_mode():
        mixed = routed_grouped(model, moe_sum(x.clone()), h, layer, weights, idx, decode)
        alone = routed_one(model, moe_sum(x[2:3].clone()), h[2:3], layer, weights[2:3], idx[2:3], True)
        prompt = routed_grouped(model, moe_sum(x.clone()), h, layer, weights, idx, False)
    assert torch.equal(mixed[2:3], alone)
    others = [0, 1, 3, 4]
    assert torch.equal(mixed[others], prompt[others])
    assert not torch.equal(mixed[2], prompt[2])  # the role decides the arithmetic
