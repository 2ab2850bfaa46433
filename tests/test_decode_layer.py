"""A decode row's whole MoE layer in one native call (``fate_edge.model.decode_layer``): the bits of the step-by-step
path (logits, the KV cache it writes, the routing the observers see), the provider's bookkeeping as its groups would
have kept it, and the general path wherever the layer, the cache, the provider or the router is one it does not take."""

from __future__ import annotations

import ctypes

import pytest
import torch
from _native_experts import decode_steps
from fate_edge.predictors import CrossLayerGate
from fate_edge.quant.native import native_status

from fate_edge import load_model
from fate_edge.model import decode_layer, row_ops
from fate_edge.model.decode_layer import DecodeLayers, build, program_of
from fate_edge.model.experts import InMemoryExpertProvider
from fate_edge.runtime.scheduler import Scheduler

pytestmark = pytest.mark.skipif(
    not (native_status()[0] and row_ops.available()[0] and decode_layer.available()[0]),
    reason="needs the native int4, row and decode layer kernels",
)

PROMPT = [3, 17, 99, 5, 250, 7, 64, 12]


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    from _tiny_moe import build_wide_moe

    return build_wide_moe(tmp_path_factory.mktemp("wide") / "m", 128, vocab=1024)


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    from _tiny_moe import build_wide_mixtral

    return build_wide_mixtral(tmp_path_factory.mktemp("mixtral") / "m", 128, vocab=1024)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    from _tiny_moe import build_wide_qwen3

    return build_wide_qwen3(tmp_path_factory.mktemp("qwen3") / "m", 128, vocab=1024)


@pytest.fixture(scope="module")
def store(wide_dir, tmp_path_factory):
    from fate_edge.format.convert import convert

    return convert(wide_dir, tmp_path_factory.mktemp("store") / "s", progress=False)


def _resident(wide_dir):
    """The checkpoint resident in bf16, its attention and every expert on the native int4 kernel."""
    from fate_edge.runtime.loader import expert_spec

    model = load_model(wide_dir, torch.bfloat16, resident_bits=4)
    model.experts = InMemoryExpertProvider.quantized(model.experts, expert_spec(model.config, 4), kernel="native-int4")
    return model


def _outcomes(monkeypatch) -> list[str]:
    """Each layer call's outcome: "whole", "tie" (the MoE half left to the general path) or "general"."""
    seen: list[str] = []
    real = DecodeLayers.run

    def run(self, x, layer, lp):
        got = real(self, x, layer, lp)
        seen.append("general" if got is None else "whole" if got[1] is None else "tie")
        return got

    monkeypatch.setattr(DecodeLayers, "run", run)
    return seen


def _step_by_step(monkeypatch) -> None:
    monkeypatch.setattr(DecodeLayers, "of", staticmethod(lambda *args: None))


def _routes(model) -> list[tuple]:
    routes: list[tuple] = []
    model.observers.append(lambda layer, h, idx, w: routes.append((layer, idx.tolist(), w.tolist(), h.clone())))
    return routes


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral", "qwen3_moe"])  # a gated shared expert; none; q/k norms
def test_a_resident_decode_runs_whole_layers_with_the_step_by_step_bits(request, monkeypatch, threads, arch):
    """Logits, and what each layer's observers see (the router's choice and weights, the MoE block's input)."""
    wide_dir = request.getfixturevalue({"qwen2_moe": "wide_dir", "mixtral": "mixtral_dir"}.get(arch, "qwen3_dir"))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = _resident(wide_dir)
        assert (model.plan()[0].mlp is None) == (arch != "qwen2_moe")
        assert (model.plan()[0].q_norm is not None) == (arch == "qwen3_moe")
        routes = _routes(model)
        seen = _outcomes(monkeypatch)
        whole = decode_steps(model, steps=6, after_prompt=lambda: (seen.clear(), routes.clear()))
        layers = model.config.num_hidden_layers
        assert seen == ["whole"] * (6 * layers)
        got = list(routes)
        _step_by_step(monkeypatch)
        model = _resident(wide_dir)
        routes = _routes(model)
        want = decode_steps(model, steps=6, after_prompt=routes.clear)
        for a, b in zip(whole, want):
            assert torch.equal(a, b)
        assert len(got) == len(routes) == 6 * layers
        for (la, ia, wa, ha), (lb, ib, wb, hb) in zip(got, routes):
            assert (la, ia, wa) == (lb, ib, wb) and torch.equal(ha, hb)
    finally:
        torch.set_num_threads(before)


def _decode(model, steps: int) -> tuple[list[torch.Tensor], object]:
    cache = model.new_cache()  # no capacity hint: the first buffers hold 64 positions
    out = []
    with torch.inference_mode():
        tok = model(torch.tensor([PROMPT], device="cpu"), cache)[0, -1].argmax().view(1, 1)  # the host's, any default
        for _ in range(steps):
            logits = model(tok, cache)
            out.append(logits)
            tok = logits[0, -1].argmax().view(1, 1)
    return out, cache


def test_it_writes_the_general_paths_cache_and_a_full_cache_goes_to_the_general_path(wide_dir, monkeypatch):
    """Past the cache's first 64 positions the general path grows it (one token), then whole layers go on."""
    seen = _outcomes(monkeypatch)
    steps = 64 - len(PROMPT) + 3
    got, cache = _decode(_resident(wide_dir), steps)
    layers = _resident(wide_dir).config.num_hidden_layers
    assert seen.count("general") == layers and seen.count("whole") == (steps - 1) * layers
    _step_by_step(monkeypatch)
    want, want_cache = _decode(_resident(wide_dir), steps)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for lay, ref in zip(cache.layers, want_cache.layers):  # the keys and values, position by position
        assert lay.length == ref.length == len(PROMPT) + steps
        for buf, ref_buf in zip(lay.buffers, ref.buffers):
            assert torch.equal(buf.narrow(2, 0, lay.length), ref_buf.narrow(2, 0, ref.length))


def test_a_router_tie_leaves_the_moe_half_to_the_general_path(wide_dir, monkeypatch):
    """The router declining (a tie that torch.topk decides): the attention half stays done, the MoE half goes the
    general way, the same logits."""
    model = _resident(wide_dir)
    want = decode_steps(model, steps=3)
    declines = ctypes.CFUNCTYPE(ctypes.c_int)(lambda: 1)  # fe_route_softmax's "a tie": 1, whatever it was given
    lib = decode_layer._kernel.lib
    fns = decode_layer.entry_points()
    decode_layer.bind(lib, [*fns[:8], ctypes.cast(declines, ctypes.c_void_p).value or 0, *fns[9:]])  # the router
    try:
        seen = _outcomes(monkeypatch)
        got = decode_steps(_resident(wide_dir), steps=3, after_prompt=seen.clear)
    finally:
        decode_layer.bind(lib, fns)
    assert seen == ["tie"] * (3 * model.config.num_hidden_layers)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_layers_it_does_not_take_get_no_program(wide_dir):
    """Experts on torch's matmul (not native int4), and a plain bf16 checkpoint: no program, the general path."""
    plain = load_model(wide_dir, torch.bfloat16, resident_bits=4)  # its experts bf16 ExpertWeights
    token = plain.experts.resident_token()
    assert token is not None  # resident: asked, but the experts do not fuse
    assert all(program_of(plain, lp, i, token) is None for i, lp in enumerate(plain.plan()))
    model = _resident(wide_dir)
    token = model.experts.resident_token()
    programs = [program_of(model, lp, i, token) for i, lp in enumerate(model.plan())]
    assert all(p is not None for p in programs)
    assert program_of(model, model.plan()[0], 0, token) is programs[0]  # kept on the plan
    assert program_of(model, model.plan()[0], 0, object()) is not programs[0]  # a new token: made again


def test_an_engine_whose_budget_holds_the_model_gives_the_same_tokens_logprobs_and_counters(store, monkeypatch):
    """Whole layers in the default engine (a budget that holds the model); the same tokens and logprobs step by step
    and from an engine that reads experts on a miss (no resident token there: no layer is asked), and the scheduler's
    counters as its groups would have kept them."""
    from fate_edge.runtime.engine import Engine
    from fate_edge.runtime.engine_config import EngineConfig
    from fate_edge.runtime.generate import GenerateConfig

    cfg = GenerateConfig(max_tokens=10, ignore_eos=True, logprobs=3)

    def run(budget: str | int) -> tuple[list, object]:
        with Engine(EngineConfig(store, budget, dtype="bfloat16")) as engine:
            out = [(r.token, r.logprob) for r in engine.stream(PROMPT, cfg)]
            return out, engine.scheduler.stats

    seen = _outcomes(monkeypatch)
    whole, stats = run("auto")
    assert len(seen) == (cfg.max_tokens - 1) * 2 and all(s == "whole" for s in seen)  # 2 layers a decode token
    seen.clear()
    on_miss, _ = run(150_000)  # a cache that holds no expert: no program, every layer the general path's
    assert seen and all(s == "general" for s in seen)
    _step_by_step(monkeypatch)
    general, want = run("auto")
    assert whole == general == on_miss
    for name in ("hits", "misses", "experts_timed", "predictions_skipped", "demand_bytes"):
        assert getattr(stats, name) == getattr(want, name), name
    assert stats.expert_s > 0


def test_an_expert_replaced_in_the_provider_is_computed_from_its_new_weights(wide_dir, monkeypatch):
    """A program holds the experts' addresses: replacing one changes the provider's token, so the program is made
    again and the whole layer reads the new expert, as the step-by-step path does."""
    model = _resident(wide_dir)
    decode_steps(model, steps=2)  # programs made
    token = model.experts.resident_token()
    experts, donor = model.experts.experts, _resident(wide_dir).experts.experts
    for layer in range(model.config.num_hidden_layers):  # every expert of every layer now its neighbour's weights
        for e in range(model.config.num_experts):
            experts[(layer, e)] = donor[(layer, (e + 1) % model.config.num_experts)]
    assert model.experts.resident_token() != token
    seen = _outcomes(monkeypatch)
    whole = decode_steps(model, steps=3, after_prompt=seen.clear)
    assert seen == ["whole"] * (3 * model.config.num_hidden_layers)
    _step_by_step(monkeypatch)
    want = decode_steps(model, steps=3)
    before = decode_steps(_resident(wide_dir), steps=3)
    assert all(torch.equal(a, b) for a, b in zip(whole, want))
    assert not all(torch.equal(a, b) for a, b in zip(whole, before))  # the new weights did change the logits


def test_a_provider_that_serves_its_own_way_keeps_seeing_its_groups(wide_dir, monkeypatch):
    """A subclass of the in-memory provider that overrides how it hands experts out (here, counting its groups) has
    no resident token: every layer goes the step-by-step way and through its groups."""

    class Counting(InMemoryExpertProvider):
        groups = 0

        def stream_groups(self, layer, expert_ids):
            type(self).groups += 1
            yield from super().stream_groups(layer, expert_ids)

    model = _resident(wide_dir)
    model.experts = Counting(model.experts.experts)
    assert model.experts.resident_token() is None
    seen = _outcomes(monkeypatch)
    decode_steps(model, steps=2, after_prompt=lambda: setattr(Counting, "groups", 0))
    assert seen == [] and Counting.groups == 2 * model.config.num_hidden_layers


def test_whole_layers_under_a_meta_default_device_give_the_same_tokens(wide_dir, monkeypatch):
    """Every buffer the layer's call writes is made on the host, whatever the default device: one made on a meta
    default device has no memory, and the kernel's write into it would kill the process."""
    model, fresh = _resident(wide_dir), _resident(wide_dir)
    want = torch.cat(_decode(model, 4)[0]).argmax(-1)  # its programs made under the usual default device
    seen = _outcomes(monkeypatch)
    with torch.device("meta"):
        got = torch.cat(_decode(model, 4)[0]).argmax(-1)
        made_here = torch.cat(_decode(fresh, 4)[0]).argmax(-1)  # its programs made under the meta default
    assert seen == ["whole"] * (2 * 4 * model.config.num_hidden_layers)  # two runs of 4 decode tokens
    assert torch.equal(got, want) and torch.equal(made_here, want)


@pytest.mark.parametrize("policy", ["lru", "fate-edge"])
def test_a_cache_under_a_budget_runs_its_layers_in_two_calls_with_the_step_by_step_tokens_and_counters(
    store, monkeypatch, policy
):
    """A budget whose cache holds 3 to 5 of the 8 experts (evicting as it reads): each decode layer's attention and
    router in one call, then its experts in a second where the cache holds every routed one, else the general path's
    MoE block on that routing (the observers told once). The same tokens and logprobs as step by step, both outcomes
    taken, the cache's entries changing under the programs (their rows refilled per call), and under LRU (no
    prefetch, whose width follows measured times) the scheduler's counters equal."""
    from fate_edge.runtime.engine import Engine
    from fate_edge.runtime.engine_config import EngineConfig
    from fate_edge.runtime.generate import GenerateConfig

    cfg = GenerateConfig(max_tokens=12, ignore_eos=True, logprobs=3)
    phases: list[int] = []
    taken: list[bool] = []
    real_call, real_take = DecodeLayers._call, Scheduler.take_cached

    def call(self, *args):
        phases.append(args[-1])
        return real_call(self, *args)

    def take(self, layer, ids, accept):
        got = real_take(self, layer, ids, accept)
        taken.append(got is not None)
        return got

    def run() -> tuple[list, object, int]:
        with Engine(EngineConfig(store, 250_000, policy=policy, dtype="bfloat16")) as engine:
            out = [(r.token, r.logprob) for r in engine.stream(PROMPT, cfg)]
            cache = engine.scheduler.cache
            assert cache is not None and 0 < len(cache.entries) < engine.model.config.num_experts * 2  # part
            return out, engine.scheduler.stats, engine.scheduler.cache.changes

    ranked_rows: list[bool] = []  # fate-edge: its decode predictions in one native call each (CrossLayerGate.top_row)
    real_top = CrossLayerGate.top_row

    def top_row(self, layer, h, n):
        got = real_top(self, layer, h, n)
        ranked_rows.append(got is not None)
        return got

    monkeypatch.setattr(DecodeLayers, "_call", call)
    monkeypatch.setattr(Scheduler, "take_cached", take)
    monkeypatch.setattr(CrossLayerGate, "top_row", top_row)
    two, stats, changes = run()
    assert (policy == "fate-edge") == any(ranked_rows)
    decode_layers = (cfg.max_tokens - 1) * 2
    assert phases.count(1) == decode_layers and phases.count(2) == taken.count(True)
    assert 0 < taken.count(True) < len(taken) == decode_layers  # both outcomes
    assert changes > 3  # evictions: rows of other experts than the program was made from
    _step_by_step(monkeypatch)
    general, want, _ = run()
    assert two == general
    if policy == "lru":
        for name in ("hits", "misses", "experts_timed", "demand_bytes", "wasted_bytes"):
            assert getattr(stats, name) == getattr(want, name), name


def test_a_program_declines_an_expert_of_another_layout(wide_dir):
    """:meth:`LayerProgram.fill` writes nothing where an expert does not take the program's layout (an expert on
    torch's matmul here; an int2 copy in a cache would be another): the caller computes that layer on the general
    path. One of its own layout is written."""
    model = _resident(wide_dir)
    experts = model.experts.resident_layer(0, model.config.num_experts)
    prog = build(model, model.plan()[0], {0: experts[0]})
    assert prog is not None
    before = bytes(prog.experts)
    plain = load_model(wide_dir, torch.bfloat16, resident_bits=4)  # its experts bf16 ExpertWeights
    other = plain.experts.resident_layer(0, model.config.num_experts)[1]
    assert not prog.fill({1: experts[1], 2: other})
    assert bytes(prog.experts) == before
    assert prog.fill({1: experts[1]})
    assert bytes(prog.experts) != before
