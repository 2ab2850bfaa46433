"""Misses computed on the CPU where the host tier holds them (policy ``miss_compute="hybrid"``, runtime.cpu_miss).

A miss that the host tier holds is decoded on the CPU from its slot and called with the token's rows sent across, or
copied up, as the per-miss rule says (runtime.miss_rule); its output joins the others, summed in expert-id order. On
this CPU-only host the "device" is the CPU too, so the hybrid run must give the very logits of the run that copies
each miss up (DESIGN.md allows 1e-4 in fp32 between paths; on one device the bits are the same), with its misses
counted where they were computed."""

from dataclasses import dataclass, field

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
from fate_edge.runtime.miss_rule import COPY, CPU, MissRule
from fate_edge.runtime.policy import get_policy


@pytest.fixture(scope="module")
def store(tmp_path_factory, bundled_dir):
    out = tmp_path_factory.mktemp("cpu-miss") / "s"
    convert(bundled_dir, out, ConvertOptions.full(bits=4, keep_bf16=False), progress=False)
    return out


@dataclass
class Recording(MissRule):
    """The run's rule, its decisions recorded: (rows, prompt, where)."""

    taken: list[tuple[int, bool, str]] = field(default_factory=list)

    def choose(self, key, rows, expert_bytes, hidden_bytes, prompt):
        where = super().choose(key, rows, expert_bytes, hidden_bytes, prompt)
        self.taken.append((rows, prompt, where))
        return where


def _run(store, miss_compute: str, monkeypatch, dtype="float32", rule: Recording | None = None, rounds: int = 1):
    """The last of ``rounds`` requests (a later one finds its prompt's experts in the host tier)."""
    monkeypatch.setattr(Engine, "_unified", property(lambda self: False))  # a device and a host budget
    policy = get_policy("lru").with_(miss_compute=miss_compute)
    cfg = GenerateConfig(max_tokens=16, ignore_eos=True, logprobs=5)
    with Engine(EngineConfig(store, "1MB", policy, dtype=dtype, host_memory="16MB")) as e:
        if rule is not None:
            e.scheduler.miss_rule = rule
        for _ in range(rounds):
            steps = [(r.token, r.logprob) for r in e.stream("def fib(n):", cfg)]
        return steps, e.request_stats, e.prefill_stats, e.scheduler.miss_rule


def _same_logits(hybrid, device):
    assert [t for t, _ in hybrid] == [t for t, _ in device]
    for (_, a), (_, b) in zip(hybrid, device):
        assert a is not None and b is not None
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert [p for _, p in a.top] == pytest.approx([p for _, p in b.top], abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hybrid_computes_host_held_decode_misses_on_the_cpu_with_the_same_logits(store, monkeypatch, dtype):
    # costs nothing measured: the first one-row decode miss measures the CPU, the prompt's copies the link
    hybrid, stats, prefill, rule = _run(store, "hybrid", monkeypatch, dtype)
    device, base, _, _ = _run(store, "device", monkeypatch, dtype)
    assert stats.cpu_computed > 0 and base.cpu_computed == 0 and base.copied_up == 0
    assert prefill.cpu_computed == 0  # the prompt's misses are copied up while the CPU's time is unknown
    assert stats.cpu_computed + stats.copied_up == stats.host_hits
    assert rule.cpu_row_s > 0 and rule.cpu_fixed_s > 0 and rule.link_s_per_byte > 0  # measured as it went
    _same_logits(hybrid, device)


@pytest.mark.slow
def test_each_miss_goes_where_the_rule_says_it_is_cheaper_with_the_same_logits(store, monkeypatch):
    config, blob = load_config(store), ExpertStore(store).precisions[4].blob_bytes
    # costs fixed (learn=0 keeps each seed; the CPU's decode of a blob seeded as next to nothing)
    fixed = dict(learn=0.0, link_latency_s=0.0, cpu_fixed_s=1e-12)
    fixed |= dict(top_k=config.num_experts_per_tok, num_experts=config.num_experts)
    device, _, _, _ = _run(store, "device", monkeypatch, rounds=2)
    cheap_cpu = Recording(cpu_row_s=1e-9, link_s_per_byte=1e-6, **fixed)
    cheap_link = Recording(cpu_row_s=1.0, link_s_per_byte=1e-12, **fixed)
    # a row costs the CPU 0.6 of a copy: a miss of one row runs there, one of two rows or more is copied up
    by_rows = Recording(cpu_row_s=0.6 * blob * 1e-9, link_s_per_byte=1e-9, **fixed)
    for rule in (cheap_cpu, cheap_link, by_rows):
        hybrid, stats, _, _ = _run(store, "hybrid", monkeypatch, rule=rule, rounds=2)
        rule.taken = rule.taken[-stats.host_hits :]  # the second request's
        _same_logits(hybrid, device)
        on_cpu = [t for t in rule.taken if t[2] == CPU]
        assert stats.cpu_computed == len(on_cpu) and stats.copied_up == len(rule.taken) - len(on_cpu)
        assert stats.cpu_computed + stats.copied_up == stats.host_hits > 0
    assert cheap_cpu.taken and all(where == CPU for _, _, where in cheap_cpu.taken)
    assert any(prompt for _, prompt, _ in cheap_cpu.taken)  # a prompt's misses too
    assert all(where == COPY for _, _, where in cheap_link.taken)
    assert all((where == CPU) == (rows == 1) for rows, _, where in by_rows.taken), by_rows.taken
    assert {rows == 1 for rows, _, _ in by_rows.taken} == {True, False}  # both sides taken


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
