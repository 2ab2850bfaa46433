"""The shared expert runs between the routing (where the scheduler issues the layer's demand reads) and the routed
experts (where the MoE block waits for them), so those reads arrive while it computes; its output is still added
last, so the logits are the same bits as with the old order (the parity and decode-path tests hold them)."""

import sys
from pathlib import Path

import torch

from fate_edge import load_model
from fate_edge.model import routed_experts
from fate_edge.model.experts import ExpertProvider

sys.path.insert(0, str(Path(__file__).parent))
from _tiny_moe import build_tiny_moe  # noqa: E402


class _Recording(ExpertProvider):
    def __init__(self, inner: ExpertProvider, events: list):
        self.inner, self.events = inner, events

    def get(self, layer, expert):
        return self.inner.get(layer, expert)

    def stream(self, layer, expert_ids):
        self.events.append(("routed", layer))
        yield from self.inner.stream(layer, expert_ids)

    def end_layer(self, layer):
        self.inner.end_layer(layer)


def _order(tmp_path, monkeypatch, tokens: int, fast: bool) -> list:
    model = load_model(build_tiny_moe(tmp_path / "tiny"))
    model.fast_decode = fast
    events: list = []
    model.experts = _Recording(model.experts, events)
    model.observers.append(lambda layer, h, idx, w: events.append(("reads issued", layer)))
    real_shared = routed_experts.shared_out

    def shared(act, h, mlp_, down):
        events.append(("shared", None))
        return real_shared(act, h, mlp_, down)

    monkeypatch.setattr(routed_experts, "shared_out", shared)  # both paths' MoE layers run routed_experts
    cache = model.new_cache()
    with torch.inference_mode():
        model(torch.tensor([[5, 9, 17, 3]]), cache)
        del events[:]
        if tokens == 1:
            model(torch.tensor([[7]]), cache)
        else:
            model(torch.tensor([[7, 8, 9]]), cache)
    return events


def _check(events, moe_layers):
    layers = [layer for kind, layer in events if kind == "routed"]
    assert layers == moe_layers
    for layer in moe_layers:
        i = events.index(("reads issued", layer))
        assert events[i + 1] == ("shared", None) and events[i + 2] == ("routed", layer)


def test_decode_computes_the_shared_expert_while_reads_land(tmp_path, monkeypatch):
    _check(_order(tmp_path, monkeypatch, tokens=1, fast=True), [0, 1, 3])  # layer 2 is a dense MLP


def test_the_general_path_does_too(tmp_path, monkeypatch):
    _check(_order(tmp_path, monkeypatch, tokens=3, fast=False), [0, 1, 3])
