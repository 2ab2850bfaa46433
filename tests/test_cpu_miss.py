"""Misses computed on the CPU where the host tier holds them (policy ``miss_compute="hybrid"``, runtime.cpu_miss).

A decode miss that the host tier holds is decoded on the CPU from its slot and called with the token's rows sent
across; its output joins the others, summed in expert-id order. On this CPU-only host the "device" is the CPU too, so
the hybrid run must give the very logits of the run that copies each miss up (DESIGN.md allows 1e-4 in fp32 between
paths; on one device the bits are the same), with its misses counted where they were computed."""

import pytest
import torch

from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.format.store import ExpertStore, decode_expert
from fate_edge.model.arch import load_config
from fate_edge.model.layer_step import ExpertInput, expert_rows
from fate_edge.runtime.cpu_miss import OnHost
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge.runtime.generate import GenerateConfig
from fate_edge.runtime.policy import get_policy


@pytest.fixture(scope="module")
def store(tmp_path_factory, bundled_dir):
    out = tmp_path_factory.mktemp("cpu-miss") / "s"
    convert(bundled_dir, out, ConvertOptions.full(bits=4, keep_bf16=False), progress=False)
    return out


def _run(store, miss_compute: str, monkeypatch, dtype="float32"):
    monkeypatch.setattr(Engine, "_unified", property(lambda self: False))  # a device and a host budget
    policy = get_policy("lru").with_(miss_compute=miss_compute)
    cfg = GenerateConfig(max_tokens=16, ignore_eos=True, logprobs=5)
    with Engine(EngineConfig(store, "1MB", policy, dtype=dtype, host_memory="16MB")) as e:
        steps = [(r.token, r.logprob) for r in e.stream("def fib(n):", cfg)]
        return steps, e.request_stats, e.prefill_stats


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hybrid_computes_host_held_decode_misses_on_the_cpu_with_the_same_logits(store, monkeypatch, dtype):
    hybrid, stats, prefill = _run(store, "hybrid", monkeypatch, dtype)
    device, base, _ = _run(store, "device", monkeypatch, dtype)
    assert stats.cpu_computed > 0 and base.cpu_computed == 0
    assert prefill.cpu_computed == 0  # a prompt's misses are copied up (many rows amortize the copy)
    assert stats.cpu_computed <= stats.host_hits
    assert [t for t, _ in hybrid] == [t for t, _ in device]
    for (_, a), (_, b) in zip(hybrid, device):
        assert a is not None and b is not None
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert [p for _, p in a.top] == pytest.approx([p for _, p in b.top], abs=1e-4)


def test_an_expert_on_the_host_is_called_like_any_other(store):
    experts, config = ExpertStore(store), load_config(store)
    ref = experts.ref(config.moe_layers[0], 3, 4)
    with open(ref.path, "rb") as f:
        f.seek(ref.offset)
        blob = torch.frombuffer(bytearray(f.read(ref.length)), dtype=torch.uint8)
    for dtype in (torch.float32, torch.bfloat16):
        inner = decode_expert(blob, experts.precisions[4], dtype, "cpu")
        wrapped = OnHost(inner)
        assert wrapped.takes_bf16 == bool(getattr(inner, "takes_bf16", False)) and wrapped.nbytes == inner.nbytes
        h = torch.randn(3, config.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
        for decode in (True, False):
            rows = ExpertInput(h, decode)
            want = expert_rows(inner, rows)
            got = expert_rows(wrapped, ExpertInput(h, decode))
            assert got.device == h.device and got.dtype == want.dtype and torch.equal(got, want)
