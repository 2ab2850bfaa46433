"""The one-token decode path (fate_edge.model.decode_step): the same logits as the general path, with fewer operators.

Operator counts are the contract (they decide decode speed at small shapes; timings are the benchmarks' job)."""

from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from fate_edge import load_model
from fate_edge.fetch.store_provider import StoreExpertProvider
from fate_edge.format.store import ExpertStore
from fate_edge.model.decode_step import roll_permutation, rope_matrix
from fate_edge.model.experts import QuantizedExpert
from fate_edge.model.rope import apply_rope

PROMPT = torch.tensor([[5, 300, 17, 2048, 99, 1000, 7, 64]])
# Operators that only make views (no kernel, no allocation of data): not what the fast path is counted on.
VIEWS = {
    "aten::view",
    "aten::select",
    "aten::slice",
    "aten::t",
    "aten::transpose",
    "aten::reshape",
    "aten::chunk",
    "aten::split",
    "aten::split_with_sizes",
    "aten::alias",
    "aten::as_strided",
    "aten::unsqueeze",
    "aten::narrow",
    "aten::expand",
    "aten::resolve_conj",
    "aten::resolve_neg",
    "aten::detach",
    "aten::lift_fresh",
}


def compute_ops(ops: Counter) -> int:
    return sum(n for name, n in ops.items() if name not in VIEWS)


def decode_logits(model, fast: bool) -> tuple[torch.Tensor, Counter]:
    """Logits of 4 decode steps after a 4-token prefill, and the aten operators those steps ran."""
    model.fast_decode = fast
    cache = model.new_cache()
    with torch.inference_mode():
        model(PROMPT[:, :4], cache)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            steps = [model(PROMPT[:, i : i + 1], cache) for i in range(4, 8)]
    ops = Counter(e.name for e in prof.events() if e.name.startswith("aten::") and not e.cpu_parent)
    return torch.cat(steps, dim=1), ops


def store_int4_model(bundled_dir):
    """The bundled model with every int4 expert of its store resident and float resident weights (the baselines'
    store: the default one quantizes the resident linears too), as the int4 side of `fate-edge bench-llamacpp`
    runs."""
    from fate_edge.format.converted_stores import ensure_store
    from fate_edge_lab.bench.sidebyside import resident_int4

    store = ensure_store(bundled_dir, cold_bits=2, progress=False, baselines=True)
    return load_model(store, torch.float32, experts=resident_int4(store))


def test_rope_matrix_rotates_as_apply_rope_does():
    d = 48
    cos, sin = torch.randn(1, d), torch.randn(1, d)
    x = torch.randn(6, d)
    want = apply_rope(x.view(1, 6, 1, d), cos, sin).view(6, d)
    assert torch.allclose(x @ rope_matrix(cos, sin, roll_permutation(d, torch.float32)), want, atol=1e-6)


def test_fast_decode_matches_the_general_path_with_fewer_operators(bundled_dir, one_thread):
    model = load_model(bundled_dir)
    assert model.fast_decode  # the bundled model's layers are all covered
    general, general_ops = decode_logits(model, fast=False)
    fast, fast_ops = decode_logits(model, fast=True)
    assert (fast - general).abs().max() < 1e-4
    assert torch.equal(fast.argmax(-1), general.argmax(-1))
    layers = model.config.num_hidden_layers
    # rope: one matmul per layer instead of mul/roll/mul/add. The MoE half of a layer is the same function on both
    # paths (layer_step), so the difference is attention's: 222 against 243 operators a token measured (12-05; the
    # general path took 275 before it shared the one-token step's in-place sums)
    assert fast_ops["aten::roll"] == 0 and general_ops["aten::roll"] >= 4 * layers
    assert compute_ops(fast_ops) < compute_ops(general_ops) - 4 * 2 * layers
    assert compute_ops(fast_ops) <= 4 * 223


def test_store_int4_experts_take_one_matmul_for_gate_and_up_and_one_cast_per_layer(bundled_dir, one_thread):
    model = store_int4_model(bundled_dir)
    e = model.experts.get(0, 0)
    assert isinstance(e, QuantizedExpert) and e.gate_up is not None and e.takes_bf16  # fused from gate and up
    general, general_ops = decode_logits(model, fast=False)
    fast, fast_ops = decode_logits(model, fast=True)
    # the same experts' arithmetic on both paths; their bf16 still rounds the paths' ulp-apart attention outputs
    # (rope as a matrix or elementwise) differently now and then
    assert ((fast - general).norm() / general.norm()).item() < 1e-4  # 1.0e-5 measured
    assert torch.equal(fast.argmax(-1), general.argmax(-1))
    steps, layers, k = 4, model.config.num_hidden_layers, model.config.num_experts_per_tok
    for ops in (fast_ops, general_ops):  # both take their experts through layer_step.expert_rows
        assert ops["aten::_weight_int4pack_mm_for_cpu"] == steps * layers * k * 2  # gate_up and down
        casts = ops["aten::to"] + ops["aten::_to_copy"]
        assert casts == steps * layers  # one bf16 copy of the gate input per layer, none per matmul
    assert compute_ops(fast_ops) < compute_ops(general_ops)


def test_fused_gate_up_computes_what_separate_gate_and_up_did(bundled_dir, one_thread):
    from fate_edge.apps.engine_args import resolve_store

    prov = StoreExpertProvider(ExpertStore(resolve_store(bundled_dir, progress=False)), bits=4)
    try:
        separate = prov.get(1, 5)
    finally:
        prov.close()
    fused = separate.fused()
    assert separate.gate_up is None and fused.gate_up is not None
    x = torch.randn(3, separate.gate.shape[1])
    assert torch.equal(fused(x), separate(x))
